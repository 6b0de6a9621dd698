"""A node off loopback requires client certificates (pd/tls.py check_listen): a connection
takes one of --max-connections before any request is read, and without client
certificates one host that reached the port held them all, so its routers got 503 (a
security probe). With them, a peer without a certificate fails the TLS handshake, which
comes before a connection counts."""
from __future__ import annotations

import socket
import ssl
import threading
import time

import httpx
import pytest
from certs import make_pki

from kvfence.pd.tls import PlaintextNetworkError, TlsSettings, check_listen, uvicorn_options
from kvfence.server.http_limits import HttpLimits, uvicorn_server

SLOTS = 3


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _router_gets_in(pki: dict, require_client_certificates: bool) -> int:
    """Serve with SLOTS connections; 2 * SLOTS peers without a certificate connect from
    127.0.0.2, try TLS and sit idle; then the router, with its certificate, asks once from
    127.0.0.1. Its status."""
    tls = TlsSettings(pki["server_cert"], pki["server_key"], pki["ca"] if require_client_certificates else None)
    # as a node is configured (cli.py): one address may hold every connection, routers being few
    limits = HttpLimits(max_connections=SLOTS, max_connections_per_address=SLOTS, header_timeout_s=30)
    server = uvicorn_server(_app, "127.0.0.1", 0, limits, log_config=None,
                            **uvicorn_options(tls, client_certificates=True))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    idle: list[socket.socket] = []
    try:
        anyone = ssl.create_default_context(cafile=pki["ca"])
        anyone.check_hostname = False
        for _ in range(2 * SLOTS):
            # from another address than the router's: what fills up is the node's total
            raw = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
            try:
                conn = anyone.wrap_socket(raw)   # TLS 1.3: a refused certificate shows at the first read
                conn.settimeout(0.3)
                try:
                    conn.recv(1)
                except (TimeoutError, ssl.SSLError, OSError):
                    pass
                idle.append(conn)
            except (ssl.SSLError, OSError):
                idle.append(raw)
        router = ssl.create_default_context(cafile=pki["ca"])
        router.check_hostname = False
        router.load_cert_chain(pki["client_cert"], pki["client_key"])
        try:
            return httpx.get(f"https://127.0.0.1:{port}/", verify=router, timeout=5).status_code
        except httpx.HTTPError:
            return 0
    finally:
        for s in idle:
            s.close()
        server.should_exit = True
        thread.join(10)


def test_peers_without_a_certificate_hold_no_slot(tmp_path):
    pki = make_pki(tmp_path, ["127.0.0.1"])
    assert _router_gets_in(pki, require_client_certificates=True) == 200
    # the case check_listen refuses: they complete TLS, hold every slot, and the router waits
    assert _router_gets_in(pki, require_client_certificates=False) == 503


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_off_loopback_needs_client_certificates(role):
    with pytest.raises(PlaintextNetworkError, match="--tls-ca"):
        check_listen(role, "10.0.0.2", TlsSettings("c.pem", "k.pem"))
    check_listen(role, "10.0.0.2", TlsSettings("c.pem", "k.pem", "ca.pem"))
    check_listen(role, "127.0.0.1", TlsSettings("c.pem", "k.pem"))                    # loopback: this host only
    check_listen(role, "10.0.0.2", TlsSettings("c.pem", "k.pem", allow_plaintext=True))   # a mesh's own mTLS
    check_listen("router", "10.0.0.2", TlsSettings("c.pem", "k.pem"))   # tenants present API keys, not certificates
