"""Noticing that an HTTP client went away, for the app's requests and a PD node's streams."""
from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request


async def watch_disconnect(request: Request, on_gone: Callable[[], None]) -> None:
    """Wait for the client to go away (the body is already read, so the next ASGI message is
    http.disconnect), then call on_gone."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            on_gone()
            return
