"""GuardedH11Protocol connections without sockets, for unit tests of http_limits: a transport
that keeps whatever the server writes (a client that reads nothing), and a server's protocol
objects built as uvicorn builds them (one class, one ServerState). Build a FakeServer inside a
running event loop: the protocol takes the loop at its creation."""
from __future__ import annotations

import asyncio

from uvicorn.config import Config
from uvicorn.server import ServerState

from kvfence.server.http_limits import ConnectionRefusals, HttpLimits, _protocol_for


class KeptTransport(asyncio.Transport):
    """Keeps what is written in `out`, all of it unsent; close() only marks it closing (as
    asyncio's does while bytes are unsent), abort() marks it aborted too."""

    def __init__(self, peer: tuple):
        super().__init__()
        self.peer, self.out, self.closed, self.aborted = peer, b"", False, False

    def get_extra_info(self, name, default=None):
        return {"peername": self.peer, "sockname": ("::1", 8000, 0, 0)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.out += data

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class FakeServer:
    def __init__(self, limits: HttpLimits, refusals: ConnectionRefusals | None = None):
        async def app(scope, receive, send):
            pass

        self.refusals = refusals or ConnectionRefusals()
        self.cls = _protocol_for(limits, self.refusals)
        self.config = Config(app, http=self.cls)
        self.config.load()
        self.state = ServerState()

    def connect(self, peer: tuple) -> KeptTransport:
        """A new connection from `peer`, made; its transport."""
        t = KeptTransport(peer)
        self.cls(config=self.config, server_state=self.state, app_state={}).connection_made(t)
        return t

    def lose_all(self) -> None:
        for protocol in self.state.connections.copy():
            protocol.connection_lost(None)
