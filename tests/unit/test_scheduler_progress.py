"""Seeded random workloads against the real Scheduler and Ledger (stand-in sequences, no
model): whatever the step budget, prefill cap, running share, pool size and tenants, with a
tenant-scoped prefix cache or without, with choices that wait for their first one's prefill,
a step with work computes something, preempts or gives a request up, and every request ends.
The PD simulation found a node that never moved again (a budget under a quarter of the cap,
prefills holding the pool, another tenant's request waiting); this walks such settings on one
node, in seconds (no PD link holding pages outside the scheduler: the simulation covers that)."""
from __future__ import annotations

import random
from collections import Counter

from scheduler_mutants import quarter_of_the_cap

from kvfence.engine.params import SamplingParams
from kvfence.engine.request_states import Event, State
from kvfence.engine.scheduler import Scheduler
from kvfence.engine.sequence import Sequence
from kvfence.kv.ledger import Ledger, Owner
from kvfence.kv.prefix_cache import PrefixCache

PAGE = 4
TRIALS = 300


def _request(led: Ledger, r: random.Random, i: int, prefixes: list[list[int]], now: int) -> list[Sequence]:
    """A request: 1-3 choices of one prompt (the later ones `after` the first), often starting
    with one of a few prefixes every tenant shares."""
    tenant = r.choice("abc")
    n = r.randint(1, led.usable_pages * PAGE // 2)
    ids = (list(r.choice(prefixes)) if r.random() < 0.5 else [])[:n]
    ids += [r.randrange(2, 1000) for _ in range(n - len(ids))]
    out: list[Sequence] = []
    for j in range(r.choice([1, 1, 2, 3])):
        s = Sequence(request_id=f"r{i}.{j}", tenant=tenant,
                     owner=Owner(led.tenant_id(tenant), Sequence.next_number()), prompt_ids=list(ids),
                     params=SamplingParams(), max_tokens=100, cache_scope=tenant, arrival=float(now))
        s.on(Event.ADMIT)
        s.after = out[0] if out else None
        out.append(s)
    return out


def _run(led: Ledger, cache: PrefixCache | None, step, now: int) -> None:
    """The runner's and LLMEngine._append's bookkeeping (a step number for the clock): the
    tokens computed, their pages written; a finished prefill publishes its prompt's pages to
    the cache (a choice attaches them while its first one still runs) and samples a token."""
    for s in step:
        seq = s.seq
        start = seq.num_computed
        seq.num_computed += s.num_new
        led.mark_written(seq.owner, seq.table, start, seq.num_computed)
        if seq.num_computed == seq.num_tokens:
            if seq.state is State.PREFILLING:
                seq.on(Event.PREFILL_DONE)
                if cache is not None:
                    cache.publish(seq.owner, seq.cache_scope, seq.all_ids, seq.table, seq.publishable)
            seq.output_ids.append(1)
            if seq.first_token_at is None:
                seq.first_token_at = float(now)


def trial(seed: int, seen: Counter | None = None) -> str | None:
    """None, or what went wrong: a step with work that did nothing, or requests left unended.
    `seen` counts what the walk went through (preemptions, cache hits, choices held back)."""
    seen = Counter() if seen is None else seen
    r = random.Random(seed)
    led = Ledger(r.randint(6, 40), PAGE)
    budget = r.choice([1, 2, 4, 8, 16, 64, 128])
    cap = r.choice([None, 1, 4, 16, 64, 256])
    cache = PrefixCache(led) if r.random() < 0.5 else None
    sch = Scheduler(led, max_num_seqs=r.choice([2, 4, 16]), token_budget=budget, prefill_budget_while_decoding=cap,
                    tenant_running_share=r.choice([0.5, 0.75, 1.0]), prefix_cache=cache)
    gen = r.randint(1, 6)
    prefixes = [[r.randrange(2, 1000) for _ in range(r.randint(1, 4) * PAGE)] for _ in range(2)]
    requests, arrivals, lives, ended, work = 0, r.randint(5, 30), 0, 0, 0
    step = 0
    while True:
        step += 1
        if step > 1000 + 10 * work:   # every step computes a token or gives pages up: ample
            return f"seed {seed}: {ended} of {lives} sequences ended after {step} steps (budget {budget}, cap {cap})"
        if requests < arrivals and r.random() < 0.3:
            for s in _request(led, r, requests, prefixes, step):
                sch.add(s)
                lives += 1   # each choice ends on its own
                work += s.num_tokens + gen
            requests += 1
        if not sch.has_work():
            if requests == arrivals:
                break
            continue
        preempted = sch.num_preemptions
        seen["choice_held_back"] += any(q.waits_for_lead for q in sch.waiting)
        out = sch.schedule()
        seen["preemptions"] += sch.num_preemptions - preempted
        seen["cached_starts"] += sum(1 for q in out if 0 < q.seq.cached_tokens == q.seq.num_computed)
        gave_up = len(sch.unservable)
        for s in sch.unservable:   # the engine aborts them (LLMEngine.end): their pages go back
            s.on(Event.ABORT)
            led.free(s.owner, s.table)
        sch.unservable.clear()
        ended += gave_up
        if not sum(q.num_new for q in out) and sch.num_preemptions == preempted and not gave_up:
            return (f"seed {seed}, step {step}: nothing ran or gave up pages (budget {budget}, cap {cap}, "
                    f"{led.num_available} pages free; running "
                    f"{[(s.tenant, s.state.name, s.num_computed, s.num_tokens) for s in sch.running]}, waiting "
                    f"{[(s.tenant, s.num_tokens) for s in sch.waiting]})")
        _run(led, cache, out, step)
        for s in list(sch.running):
            if s.state is State.DECODING and len(s.output_ids) >= gen:   # LLMEngine.end: publish, then free
                if cache is not None:
                    cache.publish(s.owner, s.cache_scope, s.all_ids, s.table, s.publishable)
                sch.remove(s)
                led.free(s.owner, s.table)
                s.on(Event.FINISH)
                ended += 1
    led.check_consistency()
    if ended != lives:
        return f"seed {seed}: {ended} of {lives} sequences ended (budget {budget}, cap {cap})"
    return None


def test_every_step_with_work_moves_and_every_request_ends():
    seen: Counter = Counter()
    bad = [b for b in (trial(s, seen) for s in range(TRIALS)) if b]
    assert not bad, f"{len(bad)} of {TRIALS} workloads stalled; first: {bad[:3]}"
    assert seen["preemptions"] and seen["cached_starts"] and seen["choice_held_back"], seen


def test_the_old_room_rule_stalls_some_workloads(monkeypatch):
    """The walk can fail: with the queue's quarter taken of the cap, not of the room a step can
    have, some workloads stall (the rule the simulation caught)."""
    monkeypatch.setattr(Scheduler, "_prefill_room", quarter_of_the_cap)
    first = next((b for b in (trial(s) for s in range(TRIALS)) if b), None)
    assert first is not None and "nothing ran" in first
