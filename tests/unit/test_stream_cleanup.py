"""A streamed response's cleanup runs once however the response ends, also when its body never
started (the client was gone first). A PD node counts its open streams down there: the count
was decremented in the body's `finally`, which a body that never starts never runs, and the
count left up held every later drain for its whole limit (found in review)."""
from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from kvfence.server.streaming import StreamWithCleanup


def _run(send_fails_at: int | None):
    started, cleaned, sent = [], [], []

    async def body():
        started.append(True)
        for i in range(3):
            yield f"line {i}\n"

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        if send_fails_at is not None and len(sent) == send_fails_at:
            raise OSError("the peer hung up")
        sent.append(message)

    resp = StreamWithCleanup(body(), lambda: cleaned.append(True), "application/x-ndjson")
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
    try:
        asyncio.run(resp(scope, receive, send))
    except (OSError, ClientDisconnect):
        pass
    return started, cleaned, sent


def test_cleanup_runs_once_when_the_stream_is_sent():
    started, cleaned, sent = _run(None)
    assert started and cleaned == [True] and sent[-1] == {"type": "http.response.body", "body": b"",
                                                          "more_body": False}


@pytest.mark.parametrize("fails_at", [0, 1])
def test_cleanup_runs_once_when_the_client_is_gone_before_the_body_starts(fails_at):
    started, cleaned, _ = _run(fails_at)
    assert cleaned == [True]
    if fails_at == 0:
        assert not started      # the body's own finally would never have run

