"""HTTP_PROXY / ALL_PROXY in the environment are not followed by the clients that carry the
cluster credential or internal traffic (pd/tls.py FOLLOW_PROXY_ENV). A security probe set
HTTP_PROXY to a listener and got the credential from `kvfence drain` and the router's node
checks, in the clear, although the nodes were on loopback."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from types import SimpleNamespace

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


def test_a_plain_http_name_that_comes_to_mean_another_host_is_not_reached(caplog):
    """The start checks a plain-HTTP node URL's name resolves to loopback only; the router
    resolves names again every few seconds, and a name that came to mean another host got
    the credential in the clear. Each address is checked as it is found."""
    from kvfence.pd.router import RouterBackend

    answers = {"now": ["127.0.0.1"]}
    router = RouterBackend("http://nodes.example:8001", "http://127.0.0.1:8002", b"k" * 32,
                           resolve=lambda host, port: answers["now"])
    assert [a.url for a in router._expand("http://nodes.example:8001")] == ["http://127.0.0.1:8001"]
    answers["now"] = ["127.0.0.1", "10.0.0.9"]
    assert [a.url for a in router._expand("http://nodes.example:8001")] == ["http://127.0.0.1:8001"]
    answers["now"] = ["10.0.0.9"]
    why: dict[str, str] = {}
    with caplog.at_level(logging.ERROR, logger="kvfence.pd.router"):
        assert router._addresses(why)["prefill"] == [] and "off loopback" in why["http://nodes.example:8001"]
        router._expand("http://nodes.example:8001")   # the monitor's next round: said once, not again
    assert sum("now resolves to http://10.0.0.9:8001" in r.getMessage() for r in caplog.records) == 1
    # the not-ready reason names it while running too (the node left the fleet with it)
    router.fleet = SimpleNamespace(serving=lambda role: [], nodes=[], ready=False)
    router._start_error = None
    assert "http://nodes.example:8001 resolves to http://10.0.0.9:8001, off loopback" in router.error
    answers["now"] = ["127.0.0.1"]
    router._expand("http://nodes.example:8001")
    assert router.refused_plain == {}
    tls = RouterBackend("https://nodes.example:8001", "http://127.0.0.1:8002", b"k" * 32,
                        resolve=lambda host, port: ["10.0.0.9"])
    assert [a.url for a in tls._expand("https://nodes.example:8001")] == ["https://10.0.0.9:8001"]


def test_drain_connects_to_the_loopback_address_it_checked(monkeypatch):
    """`kvfence drain --host NAME` checked that NAME resolves to loopback, then let httpx resolve
    it again: a name that changed in between (DNS rebinding) got the credential off-host in the
    clear. It connects to the address it checked."""
    import socket as sock

    from kvfence.pd import tls

    answers = {"now": ["127.0.0.5"]}

    def getaddrinfo(host, port, *args, **kw):
        return [(sock.AF_INET, sock.SOCK_STREAM, 6, "", (a, 0)) for a in answers["now"]]

    monkeypatch.setattr(tls.socket, "getaddrinfo", getaddrinfo)
    assert tls.loopback_address("node.example") == "127.0.0.5"
    answers["now"] = ["127.0.0.5", "10.0.0.9"]
    assert tls.loopback_address("node.example") is None and not tls.is_loopback("node.example")
    assert tls.loopback_address("[::1]") == "::1" and tls.loopback_address("10.0.0.1") is None
