"""The answer encoder that lets the event loop run: the same bytes as one json.dumps, written
a slice of a long list at a time with the loop free between slices. (CPython's C encoder holds
the GIL throughout, so encoding in a worker thread paused the loop as long: ~2.4 s for ~1M chat
logprob entries, found in review.)"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from kvfence.server.json_slices import SLICE, encode


def _plain(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _chat_answer(n: int, tokens: int) -> dict:
    entry = lambda i: {"token": f"t{i} é\n\"", "logprob": -i / 7, "bytes": [116, i % 256],  # noqa: E731
                       "top_logprobs": [{"token": "x", "logprob": -0.5, "bytes": None}]}
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": c, "message": {"role": "assistant", "content": "ok", "tool_calls": None},
         "logprobs": {"content": [entry(i) for i in range(tokens)]}, "finish_reason": "length"}
        for c in range(n)], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}


@pytest.mark.parametrize("obj", [
    {}, {"a": []}, {"a": [1] * (SLICE * 2 + 3)}, {"a": list(range(SLICE))}, {"a": list(range(SLICE + 1))},
    {"nested": [[1, 2], {"k": [None, True, 1.5]}], "s": "ünïcode \u2028"},
    {"text_offset": list(range(3 * SLICE)), "tokens": ["a"] * (3 * SLICE), "top_logprobs": [{"a": -1.0}] * 5000},
    _chat_answer(3, SLICE + 17),
])
def test_the_bytes_are_those_of_one_dumps(obj):
    assert asyncio.run(encode(obj)) == _plain(obj)


def test_the_loop_runs_between_slices():
    """No timing: a coroutine that only yields counts its turns while a long answer is encoded;
    written whole it gets none."""
    obj = _chat_answer(2, 20 * SLICE)
    turns = 0

    async def main() -> bytes:
        nonlocal turns
        task = asyncio.create_task(encode(obj))
        while not task.done():
            turns += 1
            await asyncio.sleep(0)
        return task.result()

    assert asyncio.run(main()) == _plain(obj)
    assert turns >= 2 * 20 - 2, turns


def test_nan_is_refused_as_json_dumps_refuses_it():
    with pytest.raises(ValueError):
        asyncio.run(encode({"a": [math.nan] * (SLICE + 1)}))
