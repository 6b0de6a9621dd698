"""What the PD router refuses before it contacts any node."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvfence.engine.params import SamplingParams
from kvfence.pd.router import RouterBackend


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=0), SamplingParams(max_tokens=4, prompt_logprobs=1)])
def test_prompt_scoring_is_refused_behind_the_router(params):
    """Prefill samples nothing and decode never computes the prompt: neither can score it, and
    a request for no tokens has nothing for decode to do (a 400 in server/app.py)."""
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._ready, router.facts = True, {"usable_context": 1024}
    router.fleet = SimpleNamespace(ready=True)   # a stand-in: no node is contacted before these refusals
    with pytest.raises(ValueError, match="not supported behind the PD router"):
        asyncio.run(router.submit([1, 2, 3], params, "alice"))
    assert not router._tasks


def test_a_request_the_wire_cannot_carry_ends_instead_of_hanging(monkeypatch):
    """Found in review: WireParams.of ran before the request task's try, so when it raised the
    task died, `admitted` was never set and submit() waited forever, holding the tenant's slot.
    Any failure there must end the request (the API now refuses such params itself: below)."""
    from kvfence.pd import router as router_mod

    def refuse(p):
        raise ValueError("the wire refuses these params")

    monkeypatch.setattr(router_mod.WireParams, "of", staticmethod(refuse))
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._ready, router.facts = True, {"usable_context": 1024}
    router.fleet = SimpleNamespace(ready=True)   # a stand-in: no node is contacted before these refusals

    async def go():
        return await asyncio.wait_for(router.submit([1, 2, 3], SamplingParams(max_tokens=4), "alice"), 10)

    with pytest.raises(Exception, match="wire refuses") as e:
        asyncio.run(go())
    assert not isinstance(e.value, TimeoutError)


def test_what_a_single_node_accepts_the_wire_carries():
    """The stop bounds live in engine/params.py and the wire takes them from there: at the
    bound SamplingParams crosses the wire, past it SamplingParams (so the API) refuses."""
    from kvfence.engine.params import MAX_STOP_CHARS, MAX_STOP_TOKEN_ID, MAX_STOP_TOKEN_IDS
    from kvfence.pd.messages import WireParams

    at = SamplingParams(stop=["x" * MAX_STOP_CHARS] * 16, stop_token_ids=[MAX_STOP_TOKEN_ID] * MAX_STOP_TOKEN_IDS)
    assert WireParams.from_json(WireParams.of(at).to_json()).to_params() == at
    for past in (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), dict(stop_token_ids=[MAX_STOP_TOKEN_ID + 1]),
                 dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(**past)


@pytest.mark.parametrize("code,retryable", [("server_overloaded", True), ("not_ready", True), ("draining", True),
                                            ("engine_unavailable", True),
                                            ("context_length_exceeded", False), ("invalid_request", False)])
def test_a_refusal_in_the_stream_is_retryable_as_one_in_the_status(code, retryable):
    """Found in review: nodes refuse inside a 200 stream, and that refusal never said
    retryable, so a decode node refusing for load failed the request although another decode
    node could take it (may_retry_decode needs retryable). The same codes as an HTTP refusal."""
    from kvfence.pd.messages import RejectedEvent
    from kvfence.pd.router import NodeError, may_retry_decode

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)

    async def events():
        yield RejectedEvent(code=code, message="no")

    with pytest.raises(NodeError) as e:
        asyncio.run(router._admitted("decode", events()))
    assert e.value.retryable is retryable
    assert may_retry_decode(e.value.code, e.value.retryable, admitted=False, tried=0) is retryable


def test_a_forget_message_goes_stamped_to_checked_nodes_only():
    """A node this router process never checked was never sent one of its requests, so it
    holds none of its scopes (a node keeps each router's apart): no message. It used to get an
    unstamped one, which retired the name's plain scope instead. Mutant: no such skip."""
    import json

    from kvfence.pd.messages import ForgetTenantsReply

    sent = []

    class Client:
        async def post(self, url, content=None, headers=None, **kw):
            sent.append((url, json.loads(content)))
            return SimpleNamespace(status_code=200, content=ForgetTenantsReply(pages=3).dumps())

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._client = Client()
    checked = SimpleNamespace(url="http://checked", role="prefill", address=None,
                              info=SimpleNamespace(scope_stamps=True))
    never = SimpleNamespace(url="http://never", role="decode", address=None, info=None)
    router.fleet = SimpleNamespace(nodes=[checked, never])
    assert asyncio.run(router.forget_tenants(["carol"], 2)) == 3
    assert sent == [("http://checked/internal/forget_tenants",
                     {"tenants": ["carol"], "router": router.router_id, "epoch": 2})]
