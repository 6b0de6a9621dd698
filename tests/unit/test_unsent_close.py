"""A connection closed with bytes its client never takes is reset after the send deadline.

asyncio's close() waits for the write buffer to empty, without end: an answer just under the
buffer's high-water mark (so writes never paused) that the client leaves unread held its
connection, and its place under the caps, for good. On Linux the kernel's counts show such a
connection in any state (tests/server/test_stalled_readers.py, tests/pd/test_tls_slots.py); the
transport here has no socket, so this is the rule where the system cannot say: a closing
connection with bytes in asyncio's buffer is watched.
"""
from __future__ import annotations

import asyncio

from fake_connections import FakeServer, KeptTransport

from kvfence.server.http_limits import ConnectionRefusals, HttpLimits


def _closed_with(unsent: int, wait_s: float) -> tuple[KeptTransport, ConnectionRefusals]:
    async def go() -> tuple[KeptTransport, ConnectionRefusals]:
        server = FakeServer(HttpLimits(send_timeout_s=0.3))
        server.cls.CHECK_EVERY_S = 0.05
        t = server.connect(("10.0.0.9", 5000))
        t.out = bytes(unsent)   # an answer's last bytes, under the high-water mark: writes never paused
        t.close()               # uvicorn's keep-alive timeout, or a "connection: close" answer
        await asyncio.sleep(wait_s)
        if not t.aborted:
            server.lose_all()
        return t, server.refusals

    return asyncio.run(go())


def test_a_close_waiting_on_unread_bytes_is_reset_after_the_send_deadline():
    t, refusals = _closed_with(unsent=40_000, wait_s=1.0)
    assert t.aborted, "the close still waits for bytes the client never takes"
    assert refusals.counts["send_timeout"] == 1


def test_a_close_with_nothing_unsent_is_left_to_finish():
    t, refusals = _closed_with(unsent=0, wait_s=0.6)
    assert not t.aborted and refusals.counts["send_timeout"] == 0
