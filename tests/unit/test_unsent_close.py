"""A connection closed with bytes its client never takes is reset after the send deadline.

asyncio's close() waits for the write buffer to empty, without end: an answer just under the
buffer's high-water mark (so writes never paused) that the client leaves unread held its
connection, and its place under the caps, for good. tests/server/test_stalled_readers.py shows
the paused case on a real server; how much of an answer the kernel takes varies too much to
aim at this one there, so this drives the protocol with a transport that keeps what it is given.
"""
from __future__ import annotations

import asyncio

from uvicorn.config import Config
from uvicorn.server import ServerState

from kvfence.server.http_limits import ConnectionRefusals, HttpLimits, _protocol_for


class _Unread(asyncio.Transport):
    """Takes writes and keeps them: the client reads nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.buffered, self.closing, self.aborted = 0, False, False

    def get_extra_info(self, name, default=None):
        return {"peername": ("10.0.0.9", 5000), "sockname": ("10.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.buffered += len(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _closed_with(unsent: int, wait_s: float) -> tuple[_Unread, ConnectionRefusals]:
    async def go() -> tuple[_Unread, ConnectionRefusals]:
        async def app(scope, receive, send):
            pass

        refusals = ConnectionRefusals()
        cls = _protocol_for(HttpLimits(send_timeout_s=0.3), refusals)
        cls.CHECK_EVERY_S = 0.05
        config = Config(app, http=cls)
        config.load()
        t = _Unread()
        protocol = cls(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(t)
        t.buffered = unsent   # an answer's last bytes, under the high-water mark: writes never paused
        t.close()             # uvicorn's keep-alive timeout, or a "connection: close" answer
        await asyncio.sleep(wait_s)
        if not t.aborted:
            protocol.connection_lost(None)
        return t, refusals

    return asyncio.run(go())


def test_a_close_waiting_on_unread_bytes_is_reset_after_the_send_deadline():
    t, refusals = _closed_with(unsent=40_000, wait_s=1.0)
    assert t.aborted, "the close still waits for bytes the client never takes"
    assert refusals.counts["send_timeout"] == 1


def test_a_close_with_nothing_unsent_is_left_to_finish():
    t, refusals = _closed_with(unsent=0, wait_s=0.6)
    assert not t.aborted and refusals.counts["send_timeout"] == 0
