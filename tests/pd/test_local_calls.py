"""`kvfence probe` and `kvfence drain`, the calls an operator or a kubelet makes to a process
of this host: a plain call to an HTTPS process says to pass --tls-ca (it read as "no answer"),
and drain refuses without the cluster secret before it calls anything."""
from __future__ import annotations

import socket
import ssl
import threading

from certs import make_pki

from kvfence.cli import main


def test_a_plain_call_to_an_https_process_says_to_pass_tls_ca(tmp_path, capsys):
    pki = make_pki(tmp_path, ["127.0.0.1"])
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki["server_cert"], pki["server_key"])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_tls(n: int) -> None:   # what uvicorn does with a plain request on a TLS port: hangs up
        for _ in range(n):
            conn, _ = listener.accept()
            try:
                ctx.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                conn.close()

    t = threading.Thread(target=serve_tls, args=(2,), daemon=True)
    t.start()
    assert main(["probe", "live", "--port", str(port), "--timeout", "5"]) == 1
    assert "pass --tls-ca" in capsys.readouterr().err
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    assert main(["drain", "--port", str(port), "--cluster-secret-file", str(secret), "--timeout", "5"]) == 1
    assert "pass --tls-ca" in capsys.readouterr().err
    t.join(10)
    listener.close()


def test_drain_needs_the_cluster_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVFENCE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVFENCE_CLUSTER_SECRET", raising=False)
    assert main(["drain", "--port", "9"]) == 2
    assert "secret" in capsys.readouterr().err


def test_drain_never_sends_the_credential_off_this_host_in_the_clear(tmp_path, capsys):
    """Review: `--host` took any address and posted the cluster credential, which opens every
    internal route (I11), over plain HTTP. Refused before any connection is made."""
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    assert main(["drain", "--host", "192.0.2.1", "--port", "8002", "--cluster-secret-file", str(secret)]) == 2
    assert "not sending the cluster credential to 192.0.2.1 in the clear" in capsys.readouterr().err
