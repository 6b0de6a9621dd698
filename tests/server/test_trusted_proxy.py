"""A server behind a reverse proxy the operator named (--trusted-proxy): each client behind it
is counted by its forwarded address, the console's cookie is Secure when the proxy spoke
HTTPS, and the proxy's own connections are not held to the per-address cap. From any other
address the forwarding headers change nothing."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
from server_harness import SCRAPER_KEY, TENANTS_TOML

from kvfence.server.auth_throttle import LIMIT
from kvfence.server.http_limits import HttpLimits

OPERATOR_KEY = "op-proxy-key-0001"
OPERATOR_TOML = TENANTS_TOML + f'\n[operator]\napi_keys = ["{OPERATOR_KEY}"]\n'
PROXY = "127.0.0.1"          # the tests' own client address plays the proxy
ELSEWHERE = "127.0.0.2"      # a loopback address that is not the proxy


@pytest.fixture(scope="module")
def behind_proxy(make_server):
    return make_server(tenants=OPERATOR_TOML, limits=HttpLimits(trusted_proxies=(PROXY,)))


def _scrape(srv, key: str, forwarded_for: str | None = None, source: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for:
        headers["X-Forwarded-For"] = forwarded_for
    transport = httpx.HTTPTransport(local_address=source) if source else None
    with httpx.Client(transport=transport, timeout=30) as c:
        return c.get(srv.url + "/metrics", headers=headers).status_code


def test_each_client_behind_the_proxy_has_its_own_count(behind_proxy):
    """30 wrong keys forwarded for 203.0.113.5 lock out only that client: another one behind the
    same proxy, and the proxy itself, still get in. A client's own X-Forwarded-For entry to the
    left of the proxy's does not move its count (the proxy appends the address it saw)."""
    for i in range(LIMIT):
        assert _scrape(behind_proxy, f"sk-guess-{i:05d}", forwarded_for=f"10.9.{i}.1, 203.0.113.5") == 401
    assert _scrape(behind_proxy, SCRAPER_KEY, forwarded_for="203.0.113.5") == 429
    assert _scrape(behind_proxy, SCRAPER_KEY, forwarded_for="10.9.0.1, 203.0.113.5") == 429
    assert _scrape(behind_proxy, SCRAPER_KEY, forwarded_for="203.0.113.6") == 200
    assert _scrape(behind_proxy, SCRAPER_KEY) == 200


def test_forwarding_headers_from_elsewhere_change_nothing(behind_proxy):
    """An address that is not the proxy names a new client for each guess: all count against it."""
    for i in range(LIMIT):
        assert _scrape(behind_proxy, f"sk-guess-{i:05d}", forwarded_for=f"198.51.100.{i}", source=ELSEWHERE) == 401
    assert _scrape(behind_proxy, SCRAPER_KEY, forwarded_for="198.51.100.200", source=ELSEWHERE) == 429
    assert _scrape(behind_proxy, SCRAPER_KEY, forwarded_for="198.51.100.200") == 200   # through the proxy


def _sign_in(srv, proto: str | None, source: str | None = None) -> httpx.Response:
    headers = {"X-Forwarded-Proto": proto} if proto else {}
    transport = httpx.HTTPTransport(local_address=source) if source else None
    with httpx.Client(transport=transport, timeout=30) as c:
        return c.post(srv.url + "/console/login", data={"key": OPERATOR_KEY}, headers=headers,
                      follow_redirects=False)


def test_the_console_cookie_is_secure_when_the_proxy_spoke_https(behind_proxy):
    r = _sign_in(behind_proxy, "https")
    assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower(), r.headers
    r = _sign_in(behind_proxy, None)     # the proxy reached over plain HTTP: a Secure cookie would be lost
    assert r.status_code == 303 and "secure" not in r.headers["set-cookie"].lower(), r.headers
    # not the proxy: the header is not believed (another address than the guesser's above)
    r = _sign_in(behind_proxy, "https", source="127.0.0.3")
    assert r.status_code == 303 and "secure" not in r.headers["set-cookie"].lower(), r.headers


def _held(srv, source: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10, source_address=(source, 0))
    s.sendall(b"GET /health/li")          # open and unfinished: it holds a connection
    return s


def _served(srv, source: str) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        return got


def test_the_proxy_is_bound_by_the_total_only(make_server):
    """Per address 2 of 8: the proxy holds 4 and is still served; any other address gets its 2."""
    srv = make_server(limits=HttpLimits(header_timeout_s=60.0, max_connections=8, max_connections_per_address=2,
                                        trusted_proxies=(f"{PROXY}/32",)))
    held = [_held(srv, PROXY) for _ in range(4)] + [_held(srv, ELSEWHERE) for _ in range(2)]
    try:
        time.sleep(0.3)
        assert _served(srv, PROXY).startswith(b"HTTP/1.1 200")
        assert _served(srv, ELSEWHERE).startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("bad", ["*", "proxy.internal", "10.0.0.0/33", "", "10.0.0.7/8", "0.0.0.0/0", "::/0"])
def test_a_trusted_proxy_must_be_an_address_or_network(bad):
    with pytest.raises(ValueError, match="name the proxy's own addresses"):
        HttpLimits(trusted_proxies=(bad,))


def test_the_cli_passes_trusted_proxies_and_refuses_them_on_nodes(monkeypatch, tmp_path, capsys):
    from kvfence import cli
    from kvfence.server import serve as serve_module

    seen: list[HttpLimits] = []
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: seen.append(a[7]) or 0)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cli.main(["serve", "--trusted-proxy", "10.0.0.7", "--trusted-proxy", "fd00::/64,10.1.0.0/16"]) == 0
    assert seen[-1].is_trusted_proxy("10.0.0.7") and seen[-1].is_trusted_proxy("10.1.2.3")
    assert seen[-1].is_trusted_proxy("fd00::9") and not seen[-1].is_trusted_proxy("10.0.0.8")
    assert cli.main(["serve"]) == 0 and not seen[-1].is_trusted_proxy("127.0.0.1")
    assert cli.main(["serve", "--trusted-proxy", "*"]) == 2
    assert "name the proxy's own addresses" in capsys.readouterr().err
    assert cli.main(["serve", "--role", "decode", "--trusted-proxy", "10.0.0.7"]) == 2
    assert "routers only" in capsys.readouterr().err


def test_an_ipv4_proxy_is_known_on_a_server_listening_on_ipv6():
    """With --host ::, an IPv4 proxy's connections come from ::ffff:a.b.c.d: the cap's check
    and uvicorn's (which reads X-Forwarded-For) both know it by that form too."""
    from uvicorn.middleware.proxy_headers import _TrustedHosts

    limits = HttpLimits(trusted_proxies=("10.0.0.7", "10.1.0.0/16"))
    assert limits.is_trusted_proxy("::ffff:10.0.0.7") and limits.is_trusted_proxy("::ffff:10.1.2.3")
    assert not limits.is_trusted_proxy("::ffff:10.0.0.8")
    trusted = _TrustedHosts(limits.forwarded_allow_ips())
    assert "::ffff:10.0.0.7" in trusted and "::ffff:10.1.2.3" in trusted and "10.0.0.7" in trusted
    assert "::ffff:10.0.0.8" not in trusted and "10.2.0.1" not in trusted
