"""A client that stops reading cannot hold its connection: an answer whose bytes are not taken
for the send deadline gets its connection reset, counted and logged, and frees its place.

Without the deadline asyncio keeps an unread answer in memory for as long as the client's TCP
stack acknowledges window probes (forever), and a close waits for those bytes first: the
connection, its buffer and its place under the per-address and total caps were held for
good: 16 such requests from two addresses locked every other client out of a server with 16
connections (probe).

Each client here shrinks its receive buffer and reads nothing until the server has given up;
the waits are bounds on how long that may take (a test that fails instead of hanging)."""
from __future__ import annotations

import socket
import time

import pytest
from server_harness import KEYS, MODEL, wait_for

from kvfence.server.http_limits import HttpLimits, _kernel_queued

SEND_TIMEOUT_S = 2.0
GIVE_UP_BOUND_S = 30.0


@pytest.fixture(scope="module")
def stalled(make_server):
    # a pool for 16 choices of a long prompt's echo
    return make_server(limits=HttpLimits(header_timeout_s=1.0, body_timeout_s=2.0, send_timeout_s=SEND_TIMEOUT_S),
                       kv_cache_memory="128MiB")


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEYS['alice']}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def _unread(srv, request: bytes) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: a small window
    s.settimeout(GIVE_UP_BOUND_S)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(request)
    return s


def _drain(s: socket.socket) -> tuple[int, bool]:
    """(bytes read, whether the server reset the connection) once it is closed."""
    got = 0
    try:
        while chunk := s.recv(1 << 16):
            got += len(chunk)
    except ConnectionResetError:
        return got, True
    return got, False


def _open_connections(srv) -> int:
    return sum(srv.server.config.http_protocol_class.by_address.values())


def _settled_connections(srv) -> int:
    """The open connections once those the tests' own clients just closed are gone: the server
    learns of a close a moment later, and one counted here then gone would leave the count below
    this for good (the last test's closing scrape made the next one fail, now and then)."""
    wait_for(lambda: _open_connections(srv) == 0, 10)
    return _open_connections(srv)


def _unsent(srv) -> int:
    """Bytes the server's connections hold for their clients (asyncio's buffers, the kernel's queues)."""
    return sum(p.transport.get_write_buffer_size() + _kernel_queued(p.transport)
               for p in list(srv.server.server_state.connections))


def _stalls(srv) -> float:
    return srv.state.metrics.connections.counts["send_timeout"]


def _given_up(srv, before: float) -> bool:
    return bool(wait_for(lambda: _stalls(srv) > before, GIVE_UP_BOUND_S))


# echo with 20 logprobs for each prompt token of 8 choices: ~3.8 MB in one answer, more than the
# kernel's buffers take (~2.8 MB here), so the rest waits in asyncio's (whether it does or not,
# the bytes in the kernel's queue are watched)
ECHO = (b'{"model": "%s", "prompt": "%s", "max_tokens": 1, "echo": true, "logprobs": 20, "n": 8, '
        b'"temperature": 0}' % (MODEL.encode(), b"the cat sat on the mat and " * 120))


def test_an_unread_answer_is_reset_and_frees_its_place(stalled):
    open_before, stalls_before = _settled_connections(stalled), _stalls(stalled)
    with _unread(stalled, _request("/v1/completions", ECHO)) as s:
        assert _given_up(stalled, stalls_before), "the server still holds an answer nobody reads"
        got, reset = _drain(s)
    # a reset, or the kernel would go on holding the ~2.8 MB it had taken, for the client to read
    assert reset, f"closed without a reset after {got} bytes"
    _holds_nothing(stalled, open_before, stalls_before + 1)


def test_a_stream_not_read_is_reset_and_its_request_ends(stalled):
    """Stopped reading while choices generate: the engine ends them (the client is gone), it does
    not generate on for nobody. Their prompt's echo (~7.6 MB for 16 choices) stalls the stream
    at its start; each step is slowed so that the generation surely outlasts the deadline."""
    body = ECHO.replace(b'"max_tokens": 1,', b'"max_tokens": 64, "ignore_eos": true, "stream": true,'
                        ).replace(b'"n": 8', b'"n": 16')
    open_before, stalls_before = _settled_connections(stalled), _stalls(stalled)
    left = stalled.metric("kvfence_requests_total", tenant="alice", outcome="client_disconnected")
    stalled.spy.step_delay = 0.25   # 64 steps: 16 s at least
    try:
        with _unread(stalled, _request("/v1/completions", body)) as s:
            assert _given_up(stalled, stalls_before), "the server still holds a stream nobody reads"
            assert _drain(s)[1], "closed without a reset"
        assert wait_for(lambda: stalled.metric("kvfence_requests_total", tenant="alice",
                                               outcome="client_disconnected") == left + 1, 10)
    finally:
        stalled.spy.step_delay = 0.0
    _holds_nothing(stalled, open_before, stalls_before + 1)


def _holds_nothing(srv, open_before: int, stalls: float) -> None:
    assert wait_for(lambda: _open_connections(srv) == open_before, 10), "its place is still held"
    snap = srv.wait_idle()
    assert snap.get("running") == 0 and snap.get("pages_owned") == 0, snap
    with srv.http("alice") as c:   # and the server serves on
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert srv.metric("kvfence_http_connections_refused_total", reason="send_timeout") == stalls


def test_a_slow_reader_that_keeps_reading_is_served(stalled):
    """Not a refusal of slow networks: a client that takes its answer slowly (~200 KB/s) for
    three send deadlines, then reads the rest, gets all of it. Any bytes its TCP acknowledges
    start the deadline again (asyncio's own buffer shrinks only once a third of the kernel's
    queue is free, which at this pace takes longer than the deadline: watching it alone cut
    this client off)."""
    stalls_before = _stalls(stalled)
    with _unread(stalled, _request("/v1/completions", ECHO)) as s:
        assert wait_for(lambda: _unsent(stalled) > 1 << 20, GIVE_UP_BOUND_S), "the answer never waited for it"
        got, slow_until = b"", time.monotonic() + 3 * SEND_TIMEOUT_S
        while time.monotonic() < slow_until:
            got += s.recv(4096)
            time.sleep(0.02)
        while not _complete(got):
            got += s.recv(1 << 16)
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert _stalls(stalled) == stalls_before


def _complete(got: bytes) -> bool:
    """A whole answer with a content-length."""
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return len(body) >= length
