"""A request revoked by a tenants-file reload before its stream is first read: every one of
its `n` choices is aborted and nothing of it is sent (found in review, when the other choices
were submitted on the lead's first update: the pumps started them on its abort update, under
the name's new cache scope). The real `_Run`, driven as the streaming response drives it,
over a stand-in engine that records submits and aborts."""
from __future__ import annotations

import asyncio
import re
import types

from kvfence.engine.params import SamplingParams
from kvfence.server import app
from kvfence.server.backend import Admitted, RequestHandle, Update
from kvfence.server.protocol import GenerationRequest
from kvfence.server.tenants import Tenant, TenantLimiter


class _Engine:
    """Unit-test stand-in: submit makes a handle; abort answers with the engine's last update,
    a loop turn later (as the engine thread does)."""
    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "x")
    facts = {"vocab_size": 100, "fingerprint": "fp", "usable_context": 100}

    def __init__(self) -> None:
        self.handles: dict[str, RequestHandle] = {}
        self.submits: list[str] = []
        self.aborts: list[tuple[str, str]] = []

    builds_grammars = True
    orders_choices = False

    async def submit(self, ids, params, tenant, rid, scope=None, scope_epoch=0, *, grammar=None,
                     after=None) -> RequestHandle:
        self.submits.append(rid)
        await asyncio.sleep(0)
        h = RequestHandle(rid, asyncio.Queue())
        h.admitted = Admitted(rid, len(ids), 5)
        self.handles[rid] = h
        return h

    def abort(self, rid: str, why: str) -> None:
        self.aborts.append((rid, why))
        update = Update((), "", True, "aborted", why, 3, 0, 0, abort_code="client")
        asyncio.get_running_loop().call_soon(self.handles[rid].updates.put_nowait, update)


class _Metrics:
    def finished(self, *a, **kw) -> None:
        pass


class _Request:
    async def receive(self):   # a client that stays connected
        await asyncio.Event().wait()


def test_a_request_revoked_before_its_stream_is_read_ends_every_choice():
    engine = _Engine()
    state = types.SimpleNamespace(engine=engine, facts=engine.facts, served_name="m", metrics=_Metrics(),
                                  tenants=types.SimpleNamespace(single_tenant=True))
    req = GenerationRequest(kind="chat", model=None, params=SamplingParams(max_tokens=5), stream=True, n=2)

    async def main() -> list[str]:
        lead = app._Choice(0, "r", [1, 2, 3], req.params, True)
        sibling = app._Choice(1, "r-1", [1, 2, 3], req.params, False, leader=lead)
        lead.handle = await engine.submit([1, 2, 3], req.params, "t", "r")
        sibling.handle = await engine.submit([1, 2, 3], req.params, "t", "r-1", after="r")
        limiter = TenantLimiter()
        lease = limiter.hold(Tenant("t"), b"k")
        run = app._Run(state, _Request(), [lead, sibling], Tenant("t"), lease, 0.0, req)
        lease.on_revoke = run.revoke
        assert limiter.revoke_unless(lambda _lease: False) == 1   # the reload lands first
        out = []
        async for x in run.events():     # as the streaming response does: each send lets the loop run
            out.append(x)
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        run.close()
        await asyncio.sleep(0.01)
        return out

    out = asyncio.run(main())
    assert {rid for rid, _ in engine.aborts} == {"r", "r-1"}, engine.aborts   # both stopped
    assert all(why == "API key revoked" for _, why in engine.aborts), engine.aborts
    assert any(b"api_key_revoked" in x for x in out), out
    assert not any(re.search(rb'"content":"[^"]', x) for x in out), out   # no text of it was sent
