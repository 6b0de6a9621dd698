"""HTTP_PROXY / ALL_PROXY in the environment are not followed by the clients that carry the
cluster credential or internal traffic (pd/tls.py FOLLOW_PROXY_ENV). A security probe set
HTTP_PROXY to a listener and got the credential from `kvfence drain` and the router's node
checks, in the clear, although the nodes were on loopback."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from kvfence import cli


@pytest.fixture
def proxy(monkeypatch):
    """A listener set as every proxy variable; `seen` gets the first bytes of each connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    seen: list[bytes] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                seen.append(conn.recv(4096))
            except OSError:
                seen.append(b"")
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    yield seen
    done.set()
    t.join(2)
    server.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_drain_and_probe_go_straight_to_the_node(proxy, tmp_path, monkeypatch):
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    port = _closed_port()
    assert cli.main(["drain", "--port", str(port), "--cluster-secret-file", str(secret)]) == 1
    assert cli.main(["probe", "ready", "--port", str(port)]) == 1
    assert proxy == [], proxy


def test_the_router_reaches_its_nodes_straight(proxy):
    from kvfence.pd.router import RouterBackend

    url = f"http://127.0.0.1:{_closed_port()}"
    router = RouterBackend(url, url, b"k" * 32, wait_s=0.5, poll_s=0.1)
    router.start()   # the start-up check of the nodes (its own client): none answers
    assert router.error is not None

    async def post() -> None:
        import httpx

        with pytest.raises(httpx.ConnectError):
            await router._http().post(url + "/internal/info", json={})
        await router._http().aclose()

    asyncio.run(post())
    assert proxy == [], proxy
