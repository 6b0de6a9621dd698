"""A request's `n` choices are admitted together, before anything streams (found in review:
submitted one by one as the answer ran, a later choice could be refused by a full queue, or by
another tenant's load, after the first had streamed). The server's group submit, over a
stand-in engine: every choice gets a handle, the others name their lead, and a refusal, a
client that leaves or a revoked key stops them all."""
from __future__ import annotations

import asyncio
import types

import pytest

from kvfence.engine.admission import Overloaded
from kvfence.engine.params import SamplingParams
from kvfence.server import app
from kvfence.server.backend import Admitted, RequestHandle
from kvfence.server.tenants import Tenant


class _Engine:
    """Unit-test stand-in: `refuse` ids raise Overloaded, `hang` ids never answer."""

    def __init__(self, refuse=(), hang=()) -> None:
        self.refuse, self.hang = set(refuse), set(hang)
        self.submits: list[tuple[str, str | None]] = []
        self.aborts: list[tuple[str, str]] = []
        self.cancelled: list[str] = []

    async def submit(self, ids, params, tenant, rid, scope=None, scope_epoch=0, *, grammar=None,
                     after=None) -> RequestHandle:
        self.submits.append((rid, after))
        await asyncio.sleep(0)
        if rid in self.refuse:
            raise Overloaded("The server is overloaded: its queue is full; retry shortly.")
        if rid in self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        h = RequestHandle(rid, asyncio.Queue())
        h.admitted = Admitted(rid, len(ids), 5)
        return h

    def abort(self, rid: str, why: str) -> None:
        self.aborts.append((rid, why))


class _Request:
    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self):
        await self.leave.wait()
        return {"type": "http.disconnect"}


def _choices(n: int) -> list[app._Choice]:
    lead = app._Choice(0, "r", [1, 2, 3], SamplingParams(max_tokens=5), True)
    return [lead] + [app._Choice(j, f"r-{j}", [1, 2, 3], SamplingParams(max_tokens=5), False, leader=lead)
                     for j in range(1, n)]


async def _admit(engine: _Engine, choices, request=None, revoked=None) -> None:
    """As the handler does: the leads, then the other choices, the admitted aborted on a refusal."""
    state = types.SimpleNamespace(engine=engine)
    request = request or _Request()
    revoked = revoked or asyncio.Event()
    try:
        for group in ([c for c in choices if c.lead], [c for c in choices if not c.lead]):
            await app._submit_unless_gone(state, request, group, Tenant("t"), revoked)
    except BaseException:
        app._abort_all(types.SimpleNamespace(engine=engine), choices, "another choice of the request was refused")
        raise


def test_every_choice_is_admitted_before_the_answer_and_names_its_lead():
    engine, choices = _Engine(), _choices(4)
    asyncio.run(_admit(engine, choices))
    assert all(c.handle is not None for c in choices)
    assert engine.submits[0] == ("r", None)
    assert sorted(engine.submits[1:]) == [("r-1", "r"), ("r-2", "r"), ("r-3", "r")]


def test_a_refused_choice_refuses_the_request_and_stops_the_admitted_ones():
    engine, choices = _Engine(refuse={"r-2"}), _choices(4)
    with pytest.raises(Overloaded):
        asyncio.run(_admit(engine, choices))
    aborted = {rid for rid, _ in engine.aborts}
    assert {"r", "r-1", "r-3"} <= aborted, engine.aborts   # every admitted one: nothing is left running


def test_a_client_that_leaves_while_choices_wait_stops_them_all():
    engine, choices = _Engine(hang={"r-2"}), _choices(3)
    request = _Request()

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.05, request.leave.set)
        await _admit(engine, choices, request)

    with pytest.raises(app._ClientGone):
        asyncio.run(main())
    assert engine.cancelled == ["r-2"]
    assert {"r", "r-1"} <= {rid for rid, _ in engine.aborts}, engine.aborts


def test_a_key_revoked_while_choices_wait_stops_them_all():
    engine, choices = _Engine(hang={"r-1"}), _choices(3)
    revoked = asyncio.Event()

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.05, revoked.set)
        await _admit(engine, choices, revoked=revoked)

    with pytest.raises(app.KeyRevoked):
        asyncio.run(main())
    assert engine.cancelled == ["r-1"]
    assert ("r-2", "API key revoked") in engine.aborts   # admitted beside the one that waited
    assert {"r", "r-2"} <= {rid for rid, _ in engine.aborts}, engine.aborts


def test_a_request_cancelled_while_its_choices_wait_leaves_none_running():
    """The handler's task cancelled (the server stopping it) while one choice is admitted and
    another still waits: both are aborted, the admitted one by its id, though it never got its
    handle (found in review: it ran to max_tokens with no reader and its lease went uncharged)."""
    engine = _Engine(hang={"r-1"})
    lead = app._Choice(0, "r", [1, 2, 3], SamplingParams(max_tokens=5), True)
    other = app._Choice(1, "r-1", [4, 5, 6], SamplingParams(max_tokens=5), True)   # a second prompt's

    async def main() -> None:
        task = asyncio.ensure_future(app._submit_unless_gone(types.SimpleNamespace(engine=engine), _Request(),
                                                             [lead, other], Tenant("t"), asyncio.Event()))
        await asyncio.sleep(0.05)          # "r" admitted, "r-1" waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.cancelled == ["r-1"]
    assert "r" in {rid for rid, _ in engine.aborts}, engine.aborts


def test_a_refused_request_pays_for_what_its_admitted_choices_generated():
    """Behind the PD router the first choices generate while a later one waits for decode's
    pages; if that one fails, the request is refused, and its tenant's tokens_per_minute keeps
    what the others made (their updates so far), not a full refund (a review)."""
    from kvfence.server.backend import Update

    choices = _choices(3)
    for c, made in zip(choices, (7, 4)):   # the third was never admitted
        c.handle = RequestHandle(c.rid, asyncio.Queue())
        for k in range(1, made + 1):
            c.handle.updates.put_nowait(Update((k,), "x", False, None, None, 3, k, 0))
    assert app._tokens_generated(choices) == 7 + 4
    assert app._tokens_generated(_choices(2)) == 0
