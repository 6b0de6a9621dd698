"""What the PD router refuses before it contacts any node."""
from __future__ import annotations

import asyncio

import pytest

from kvfence.engine.params import SamplingParams
from kvfence.pd.router import RouterBackend


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=0), SamplingParams(max_tokens=4, prompt_logprobs=1)])
def test_prompt_scoring_is_refused_behind_the_router(params):
    """Prefill samples nothing and decode never computes the prompt: neither can score it, and
    a request for no tokens has nothing for decode to do (a 400 in server/app.py)."""
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._ready, router.facts = True, {"usable_context": 1024}
    with pytest.raises(ValueError, match="not supported behind the PD router"):
        asyncio.run(router.submit([1, 2, 3], params, "alice"))
    assert not router._tasks
