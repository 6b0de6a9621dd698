"""The simulation with requests for n > 1 choices (SimConfig.draw(choices=True)), as the server
and the PD router serve them: every choice is submitted at once, a later choice starts its
prefill once its first choice's prompt is held there (attaching those pages from prefill's
cache), decode reserves a request's choices by when the first arrived (the handoff's
choice_of), one refused before admission ends the request (the server aborts the others),
and a client that leaves ends them all. Every invariant is checked after every step, as in
test_simulation.py, and at the end no node still counts a client request in its queues."""
from __future__ import annotations

import functools

import pytest

from kvfence.pd.decode import KvImporter, _request_of
from kvfence.sim.cluster import SimFailure, simulate

CHOICE_SEEDS = (1, 2)   # between them: choices that attach their first choice's pages, decode queueing a
#                         request's choices together, choices dropped after another was refused
LIVES = 400


@functools.cache
def clean(seed: int):
    return simulate(seed, LIVES, choices=True)


@pytest.mark.parametrize("seed", CHOICE_SEEDS)
def test_requests_for_several_choices_hold_every_invariant(seed):
    r = clean(seed)
    print(f"seed {seed}: {r.lives} lives, {r.steps} steps, {r.seconds:.1f} s; {dict(r.outcomes)}")
    assert sum(r.outcomes.values()) >= LIVES   # a request's choices are lives of their own


def test_the_choice_runs_cover_every_path():
    stats = sum((clean(s).stats for s in CHOICE_SEEDS), start=type(clean(CHOICE_SEEDS[0]).stats)())
    outcomes = sum((clean(s).outcomes for s in CHOICE_SEEDS), start=type(clean(CHOICE_SEEDS[0]).outcomes)())
    for path in ("choice_requests", "choice_prompt_pages_attached", "decode_choices_queued_together",
                 "choices_dropped"):
        assert stats[path] > 0, path
    assert outcomes["choice dropped (another failed)"] > 0


def test_a_choice_run_replays_exactly():
    a, b = simulate(3, 150, choices=True), simulate(3, 150, choices=True)
    assert (a.digest, a.steps, a.outcomes, a.stats) == (b.digest, b.steps, b.outcomes, b.stats)
    assert a.stats["choice_requests"] > 0


def test_decode_that_never_forgets_a_client_request_is_caught_as_a_leak(monkeypatch):
    """Decode counts each client request's choices in its queue (their place in the
    reservation order, keyed by the handoff's choice_of); an end that does not take the
    entry off leaves it behind for the node's life, one more with every request."""
    on_end = KvImporter.on_end

    def keeps_the_entry(self, seq, event, reader_stopped):
        key = _request_of(seq)
        entry = self._requests.get(key)
        on_end(self, seq, event, reader_stopped)
        if entry is not None:
            self._requests.setdefault(key, entry)
    monkeypatch.setattr(KvImporter, "on_end", keeps_the_entry)
    with pytest.raises(SimFailure) as e:
        simulate(CHOICE_SEEDS[0], LIVES, choices=True)
    print(e.value.report())
    assert e.value.invariant == "leak" and "client requests" in e.value.message


def test_the_livelock_the_choice_campaign_found_is_caught(monkeypatch):
    """Seed 138 of the first --choices campaign: a prefill node whose step budget (8) is under the
    prefill cap (256) kept a quarter of the cap for a waiting request; its running prefills had
    no room left, held the pool, and the node never moved again. The old rule, put back, is
    caught as liveness (tests/unit/test_scheduler.py holds the fix)."""
    from kvfence.engine.scheduler import QUEUE_SHARE, Scheduler

    def quarter_of_the_cap(self, budget, capped_so_far, capped, for_queue=False):
        cap = self.prefill_budget_while_decoding
        room, whole = ((min(budget, cap - capped_so_far), cap) if capped and cap is not None
                       else (budget, self.token_budget))
        return room - whole // QUEUE_SHARE if for_queue else room
    monkeypatch.setattr(Scheduler, "_prefill_room", quarter_of_the_cap)
    with pytest.raises(SimFailure) as e:
        simulate(138, 500, choices=True)
    assert e.value.invariant == "liveness"
