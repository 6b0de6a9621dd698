"""Slow and idle clients cannot hold a connection: a request line or headers that do not
arrive within the header deadline get 408 and a close, a body trickled slower than the body
deadline gets the same, and past the connection cap new connections get 503 at once. Other
clients are served throughout, and nothing the slow requests touched stays held.

Each wait below is a bound on a read (a test that fails instead of hanging), not a speed
assertion: without the deadlines these sockets stay open until the read times out."""
from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
from server_harness import wait_for

from kvfence.server.http_limits import HttpLimits

READ_BOUND_S = 20.0


@pytest.fixture(scope="module")
def guarded(make_server):
    return make_server(limits=HttpLimits(header_timeout_s=1.0, body_timeout_s=2.0))


def _connect(srv, source: str | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=READ_BOUND_S,
                                 source_address=(source, 0) if source else None)
    return s


def _served_again(srv) -> None:
    """Once held connections are closed, a new one is served again (within READ_BOUND_S)."""
    deadline = time.monotonic() + READ_BOUND_S
    while True:
        with httpx.Client(timeout=READ_BOUND_S) as c:
            r = c.get(srv.url + "/health/live")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails (socket.timeout) if it never does."""
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return got
        got += chunk


def _completion_ok(srv) -> None:
    with srv.http("alice") as c:
        r = c.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_half_sent_request_line_gets_408_and_a_close(guarded):
    before = guarded.state.metrics.connections.counts["header_timeout"]
    with _connect(guarded) as s:
        s.sendall(b"POST /v1/completions HTT")
        _completion_ok(guarded)          # served while the slow one waits
        got = _read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"request headers not received in time" in got
    assert guarded.metric("kvfence_http_connections_refused_total", reason="header_timeout") == before + 1


def test_an_idle_connection_is_closed_silently(guarded, caplog):
    """No byte sent: closed without a 408, which on a kept-alive connection could race the
    client's next request and be read as its answer. One that never sent a request counts as a
    header timeout; a kept-alive one that has been served is an ordinary idle close, neither
    counted nor logged as a refusal (Prometheus' own scrapes keep connections open longer)."""
    counts = guarded.state.metrics.connections.counts   # the server is the module's: count from here
    before = counts["header_timeout"]
    with _connect(guarded) as s:
        got = _read_until_closed(s)
    assert got == b""
    assert counts["header_timeout"] == before + 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvfence.http"), _connect(guarded) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        got = _read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1
    assert counts["header_timeout"] == before + 1
    assert not [r for r in caplog.records if "did not arrive" in r.getMessage()]


def test_headers_trickled_on_a_kept_alive_connection_are_cut(guarded):
    with _connect(guarded) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        for piece in (b"GET /health", b"/live HTT", b"P/1.1\r\n", b"host"):   # slower than the deadline
            try:
                s.sendall(piece)
            except OSError:
                break
            time.sleep(0.4)
        got = _read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]


def test_a_trickled_body_gets_408_and_holds_nothing(guarded):
    body = b'{"prompt": "The sky is", "max_tokens": 3}' + b" " * 200
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer sk-alice-0001\r\ncontent-length: %d\r\n\r\n" % len(body))
    sent = 0
    counts = {k: guarded.metric("kvfence_requests_total", tenant="alice", outcome=k)
              for k in ("invalid", "client_disconnected")}
    invalid = guarded.metric("kvfence_admission_rejections_total", reason="invalid_request")
    with _connect(guarded) as s:
        s.sendall(head)
        s.settimeout(0.3)
        got = b""
        deadline = time.monotonic() + READ_BOUND_S
        while time.monotonic() < deadline:
            try:
                s.sendall(body[sent:sent + 1])    # one byte per 0.3 s: the body needs a minute
                sent += 1
            except OSError:
                break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
        s.settimeout(READ_BOUND_S)
        try:
            got += _read_until_closed(s)
        except OSError:
            pass                                   # reset after the 408 is also a close
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"request body not received in time" in got
    assert sent < len(body)
    # a client that never finished its body: not the tenant's malformed request (it was counted
    # as a 400 invalid_request nobody received; found by an operator's-view probe)
    assert wait_for(lambda: guarded.metric("kvfence_requests_total", tenant="alice", outcome="client_disconnected")
                    == counts["client_disconnected"] + 1, timeout=READ_BOUND_S)
    assert guarded.metric("kvfence_requests_total", tenant="alice", outcome="invalid") == counts["invalid"]
    assert guarded.metric("kvfence_admission_rejections_total", reason="invalid_request") == invalid
    _completion_ok(guarded)
    snap = guarded.wait_idle()
    assert snap["pages_owned"] == 0
    assert guarded.state.limiter.in_flight("alice") == 0


def test_connections_past_the_cap_get_503_at_once_and_the_cap_frees(make_server):
    srv = make_server(limits=HttpLimits(header_timeout_s=60.0, max_connections=4, max_connections_per_address=4))
    held = [_connect(srv) for _ in range(4)]
    try:
        for s in held:
            s.sendall(b"GET /health/li")      # open and unfinished: each holds a connection
        time.sleep(0.3)
        with httpx.Client(timeout=READ_BOUND_S) as c:
            r = c.get(srv.url + "/health/live")
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_overloaded"
    finally:
        for s in held:
            s.close()
    _served_again(srv)


def test_many_slow_clients_at_once_do_not_stop_the_others(guarded):
    held = [_connect(guarded) for _ in range(30)]
    for s in held:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n")
    errors: list[BaseException] = []

    def served():
        try:
            _completion_ok(guarded)
        except BaseException as e:      # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    workers = [threading.Thread(target=served) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(READ_BOUND_S * 3)
    closed = 0
    for s in held:
        with s:
            if _read_until_closed(s).startswith(b"HTTP/1.1 408"):
                closed += 1
    assert not errors, errors
    assert closed == len(held)


def test_one_address_cannot_take_every_connection(make_server, caplog):
    """127.0.0.1 holds its 3 (of 8); its fourth is answered 503 before it is read, while
    127.0.0.2 (another client on loopback) is served; once one closes, 127.0.0.1 gets in again."""
    srv = make_server(limits=HttpLimits(header_timeout_s=60.0, max_connections=8, max_connections_per_address=3))
    held = [_connect(srv) for _ in range(3)]
    try:
        for s in held:
            s.sendall(b"GET /health/li")      # open and unfinished
        time.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="kvfence.http"):
            for _ in range(5):
                extra = _connect(srv)
                extra.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
                got = _read_until_closed(extra)
                extra.close()
                assert got.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in got.lower(), got[:300]
                assert b'"code": "server_overloaded"' in got and b"from your address" in got
        # five refusals, counted for /metrics, and one log line for them (not one per attempt)
        assert sum("refusing a connection from 127.0.0.1" in r.getMessage() for r in caplog.records) == 1
        assert srv.state.metrics.connections.counts["per_address_cap"] == 5
        other = _connect(srv, source="127.0.0.2")
        other.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_until_closed(other).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for s in held:
            s.close()
    _served_again(srv)   # the count goes down as they close
    assert srv.metric("kvfence_http_connections_refused_total", reason="per_address_cap") == 5
    assert HttpLimits(max_connections=100).per_address == 50


def test_refusal_log_lines_are_one_per_reason_and_address_every_quiet_period(caplog):
    from kvfence.server.http_limits import ConnectionRefusals

    now = [0.0]
    r = ConnectionRefusals(quiet_s=10.0, max_addresses=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvfence.http"):
        for i in range(100):
            now[0] = i * 0.05
            r.note("per_address_cap", "10.0.0.1", "refused %s", "10.0.0.1")
        r.note("header_timeout", "10.0.0.1", "slow %s", "10.0.0.1")       # another reason: its own line
        r.note("per_address_cap", "10.0.0.2", "refused %s", "10.0.0.2")   # another address: its own line
        now[0] = 15.0
        r.note("per_address_cap", "10.0.0.1", "refused %s", "10.0.0.1")
    lines = [x.getMessage() for x in caplog.records]
    assert lines[:3] == ["refused 10.0.0.1", "slow 10.0.0.1", "refused 10.0.0.2"]
    assert lines[3] == "refused 10.0.0.1 (and 99 more like it in the 15 s before)" and len(lines) == 4
    assert r.counts == {"per_address_cap": 102, "header_timeout": 1, "body_timeout": 0, "send_timeout": 0,
                        "tls_handshakes_in_progress": 0, "tls_handshake_failed": 0}
    for i in range(50):                     # many addresses: what it remembers stays bounded
        r.note("body_timeout", f"10.1.0.{i}", "x")
    assert len(r._logged) <= 3


def test_the_cli_passes_the_per_address_cap(monkeypatch, tmp_path):
    from kvfence import cli
    from kvfence.server import serve as serve_module

    seen: list[HttpLimits] = []
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: seen.append(a[7]) or 0)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cli.main(["serve", "--max-connections", "64", "--max-connections-per-address", "7"]) == 0
    assert seen[-1].max_connections == 64 and seen[-1].per_address == 7
    assert cli.main(["serve", "--max-connections", "64"]) == 0
    assert seen[-1].per_address == 32
    assert cli.main(["serve", "--max-connections-per-address", "0"]) == 2     # refused, with a message
    assert cli.main(["serve", "--send-timeout", "7.5"]) == 0
    assert seen[-1].send_timeout_s == 7.5 and seen[-2].send_timeout_s == 60.0
    assert cli.main(["serve", "--send-timeout", "0"]) == 2
