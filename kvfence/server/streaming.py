"""A streamed response whose cleanup runs however it ends.

A generator's `finally` runs only if the generator started: when the client is gone before
Starlette first iterates the body, the body never starts and its cleanup would never run. So
what must happen once per response (release a tenant's slot, close a request's run, count a
node's open stream down) goes in `cleanup`, which runs when the response is done, sent or not.
"""
from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import StreamingResponse


class StreamWithCleanup(StreamingResponse):
    def __init__(self, content, cleanup: Callable[[], None], media_type: str, headers: dict[str, str] | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def event_stream(content, cleanup: Callable[[], None]) -> StreamWithCleanup:
    """Server-sent events (the OpenAI routes' streams)."""
    return StreamWithCleanup(content, cleanup, "text/event-stream",
                             {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
