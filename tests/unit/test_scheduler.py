"""Scheduling decisions on a real ledger with stand-in sequences (no model)."""
from __future__ import annotations

import time
from collections import Counter

from kvfence.engine.params import SamplingParams
from kvfence.engine.request_states import Event, State
from kvfence.engine.scheduler import Scheduler
from kvfence.engine.sequence import Sequence
from kvfence.kv.ledger import BlockTable, Ledger, Owner
from kvfence.kv.prefix_cache import PrefixCache


def make_seq(led: Ledger, n_prompt: int, i: int, tenant: str = "t") -> Sequence:
    s = Sequence(request_id=f"r{i}", tenant=tenant, owner=Owner(led.tenant_id(tenant), Sequence.next_number()),
                 prompt_ids=[7] * n_prompt, params=SamplingParams(), max_tokens=100, cache_scope=tenant)
    s.on(Event.ADMIT)
    return s


def fake_run(step):
    """What the runner does to the bookkeeping: tokens computed; a finished prefill samples one."""
    for s in step:
        s.seq.num_computed += s.num_new
        if s.seq.num_computed == s.seq.num_tokens:
            if s.seq.state is State.PREFILLING:
                s.seq.on(Event.PREFILL_DONE)
            s.seq.output_ids.append(1)


def test_chunked_prefill_respects_token_budget_and_decodes_go_first():
    led = Ledger(64, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=10)
    a, b = make_seq(led, 3, 0), make_seq(led, 25, 1)
    sch.add(a)
    sch.add(b)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r0", 3), ("r1", 7)]
    fake_run(step)
    step = sch.schedule()  # a decodes (1 token) before b's next chunk (9 tokens)
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r0", 1), ("r1", 9)]
    assert sum(s.num_new for s in step) <= 10
    for s in step:
        assert len(s.seq.table) * 4 >= s.seq.num_computed + s.num_new


def test_pool_pressure_preempts_the_newest_and_it_comes_back():
    led = Ledger(7, 4)  # 6 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    a, b = make_seq(led, 8, 0), make_seq(led, 8, 1)  # 2 pages each
    sch.add(a)
    sch.add(b)
    fake_run(sch.schedule())
    for _ in range(12):  # both decode until the pool cannot hold both
        step = sch.schedule()
        fake_run(step)
        if sch.num_preemptions:
            break
    assert sch.num_preemptions == 1
    assert b.state is State.WAITING and b.num_computed == 0 and len(b.table) == 0
    assert a.state is State.DECODING
    assert led.num_owned == len(a.table)
    led.check_consistency()


def test_request_that_cannot_fit_even_alone_is_reported_not_looped():
    led = Ledger(3, 4)  # 2 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    big = make_seq(led, 12, 0)  # needs 3 pages
    sch.add(big)
    assert sch.schedule() == []
    assert sch.unservable == [big] and not sch.has_work()


def test_max_num_seqs_caps_the_running_set():
    led = Ledger(64, 4)
    sch = Scheduler(led, max_num_seqs=2, token_budget=100)
    seqs = [make_seq(led, 2, i) for i in range(4)]
    for s in seqs:
        sch.add(s)
    step = sch.schedule()
    assert len(step) == 2 and len(sch.waiting) == 2


def _decoding(led: Ledger, sch: Scheduler, n: int) -> list[Sequence]:
    """n one-token prompts, scheduled and run once: they decode from the next step on, and
    prompts made after this arrive while they stream."""
    seqs = [make_seq(led, 1, 100 + i) for i in range(n)]
    for s in seqs:
        sch.add(s)
    fake_run(sch.schedule())
    for s in seqs:
        s.first_token_at = time.perf_counter()
    assert all(s.state is State.DECODING for s in seqs)
    return seqs


def test_prefill_is_capped_while_sequences_decode():
    led = Ledger(128, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    decoders = _decoding(led, sch, 3)
    long, short = make_seq(led, 30, 0), make_seq(led, 5, 1)
    sch.add(long)
    sch.add(short)
    for _ in range(6):
        step = sch.schedule()
        decodes = [s for s in step if s.seq.state is State.DECODING]
        assert {s.request_id for s in decoders} <= {s.seq.request_id for s in decodes}  # none skipped
        assert sum(s.num_new for s in step if s.seq.state is not State.DECODING) <= 12
        fake_run(step)
    # 30 + 5 prompt tokens at 12 a step: both prefilled within the six steps, none starved
    assert long.state is State.DECODING and short.state is State.DECODING
    led.check_consistency()


def test_continued_and_new_prefills_share_the_cap():
    led = Ledger(128, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    _decoding(led, sch, 2)
    a, b = make_seq(led, 20, 0), make_seq(led, 20, 1)
    sch.add(a)
    sch.add(b)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step][2:] == [("r0", 12)]
    fake_run(step)
    step = sch.schedule()  # a continues (8 left), b starts with what the cap leaves
    assert [(s.seq.request_id, s.num_new) for s in step][2:] == [("r0", 8), ("r1", 4)]


def test_a_burst_into_an_idle_engine_prefills_with_the_whole_budget():
    led = Ledger(128, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    seqs = [make_seq(led, 40, i) for i in range(3)]
    for s in seqs:
        sch.add(s)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r0", 40), ("r1", 40), ("r2", 20)]
    fake_run(step)
    for s in seqs[:2]:
        s.first_token_at = time.perf_counter()
    # r0 and r1 stream now, but r2 was waiting before they started: it finishes at full speed,
    # as it did before the cap (the fixed workload's TTFT), while a prompt arriving now is capped
    # (the burst's chunk does not use up the cap: the late one starts beside it, capped)
    late = make_seq(led, 40, 3)
    sch.add(late)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r0", 1), ("r1", 1), ("r2", 20), ("r3", 12)]
    fake_run(step)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step][-1] == ("r3", 12)


def test_without_a_cap_a_step_that_decodes_prefills_with_the_whole_budget():
    led = Ledger(128, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100)
    _decoding(led, sch, 2)
    sch.add(make_seq(led, 200, 0))
    step = sch.schedule()
    assert [s.num_new for s in step] == [1, 1, 98]


def test_a_prompt_that_queued_on_a_busy_engine_stays_capped_after_its_streams_end():
    """On a backlogged engine the streams change while prompts wait: one that arrived while the
    old streams ran is not a burst into an idle engine, so it stays capped beside the new ones
    (uncapped, it stalled them with whole-budget steps: ITL p99 3x the step target)."""
    led = Ledger(128, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    (old,) = _decoding(led, sch, 1)
    new = make_seq(led, 1, 1)
    sch.add(new)
    queued = make_seq(led, 40, 2)            # arrives while `old` streams, before `new` does
    sch.add(queued)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r100", 1), ("r1", 1), ("r2", 11)]
    fake_run(step)
    new.first_token_at = time.perf_counter()
    sch.remove(old)                           # the old stream ends; `new` streams on
    led.free(old.owner, old.table)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r1", 1), ("r2", 12)]
    fake_run(step)
    # once the engine is idle, what arrives is a burst again: the whole budget
    sch.remove(new)
    sch.remove(queued)
    burst = make_seq(led, 40, 3)
    sch.add(burst)
    assert [(s.seq.request_id, s.num_new) for s in sch.schedule()] == [("r3", 40)]


def test_a_prefix_match_let_go_for_lack_of_pages_is_not_counted_each_step():
    """Found in review: the head of the queue matched its cached prefix, did not fit, let go of
    the pages and matched again next step, counting its hit tokens every step it waited
    (kvfence_prefix_cache_hit_tokens) and keeping cached_tokens it never used."""
    from kvfence.kv.prefix_cache import PrefixCache

    def cached_seq(led, n, i):            # a request of tenant t in its own cache scope, as the engine makes it
        s = Sequence(request_id=f"r{i}", tenant="t", owner=Owner(led.tenant_id("t"), Sequence.next_number(),
                                                                  scope=led.tenant_id("t")),
                     prompt_ids=[7] * n, params=SamplingParams(), max_tokens=100, cache_scope="t")
        s.on(Event.ADMIT)
        return s

    led = Ledger(9, 4)                    # 8 usable pages
    cache = PrefixCache(led)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100, prefix_cache=cache)
    a = cached_seq(led, 13, 0)            # 4 pages; its 3 full prompt pages go to the cache
    sch.add(a)
    fake_run(sch.schedule())
    led.mark_written(a.owner, a.table, 0, a.num_computed)   # what the forward pass records
    assert cache.publish(a.owner, a.cache_scope, a.all_ids, a.table, a.num_computed) == 3
    filler = cached_seq(led, 12, 1)       # 3 pages (its prefix is a's: 2 cached pages, 1 of its own)
    sch.add(filler)
    fake_run(sch.schedule())
    b = cached_seq(led, 40, 2)            # shares a's 3 pages, needs 7 more: too few are free
    sch.add(b)
    for _ in range(3):
        fake_run(sch.schedule())
        assert b.state is State.WAITING and len(b.table) == 0
    assert cache.hits == filler.cached_tokens == 8 and b.cached_tokens == 0   # 44 before: b counted 12 a step
    led.check_consistency()


def _finish(sch: Scheduler, led: Ledger, seq: Sequence) -> None:
    seq.on(Event.FINISH)
    led.free(seq.owner, seq.table)
    sch.remove(seq)


def test_free_slots_go_tenant_by_tenant_not_in_arrival_order():
    """alice queues six before bob and carol send one each: as alice's running requests end,
    bob's and carol's start before her queued ones (FIFO made them wait for all six)."""
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=2, token_budget=100)
    alice = [make_seq(led, 2, i, "alice") for i in range(6)]
    for s in alice:
        sch.add(s)
    bob, carol = make_seq(led, 2, 10, "bob"), make_seq(led, 2, 11, "carol")
    sch.add(bob)
    sch.add(carol)
    step = sch.schedule()
    assert [x.seq for x in step] == [alice[0], bob]     # alice has none running yet: her oldest; then bob
    fake_run(step)
    _finish(sch, led, alice[0])
    step = sch.schedule()
    assert step[-1].seq is carol                         # bob 1 running, alice 0, carol 0: carol is older in line
    fake_run(step)
    _finish(sch, led, bob)
    _finish(sch, led, carol)
    started = [x.seq for x in sch.schedule()]
    assert started == [alice[1], alice[2]]              # alone again: alice's in her order


def test_one_tenant_is_served_in_arrival_order():
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=1, token_budget=100)
    seqs = [make_seq(led, 2, i) for i in range(3)]
    for s in seqs:
        sch.add(s)
    order = []
    while sch.has_work():
        step = sch.schedule()
        fake_run(step)
        for x in step:
            order.append(x.seq.request_id)
            _finish(sch, led, x.seq)
    assert order == ["r0", "r1", "r2"]


def test_a_step_that_preempts_starts_nothing_new():
    """Pages freed by preempting go to the sequences that run, not to a newcomer that the next
    page shortage preempts in turn (each round recomputes its prompt). Measured on a tight
    pool (16 requests of 60 + 60 tokens, 100 pages of 4, budget 64): 4610 tokens computed for
    1904 needed before, 3575 with this rule, in as many steps."""
    led = Ledger(9, 4)   # 8 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    a, b = make_seq(led, 8, 0, "alice"), make_seq(led, 8, 1, "alice")   # 2 pages each, a 3rd to decode
    hog = make_seq(led, 12, 2, "alice")                                  # 3 pages
    for s in (a, b, hog):
        sch.add(s)
    fake_run(sch.schedule())
    assert led.num_available == 1
    late = make_seq(led, 4, 3, "bob")     # one page; bob runs nothing: first in line
    sch.add(late)
    step = sch.schedule()                 # a takes the free page; b's preempts hog
    assert sch.num_preemptions == 1 and hog.state is State.WAITING
    assert [x.seq for x in step] == [a, b] and late.state is State.WAITING
    fake_run(step)
    step = sch.schedule()                 # the next step starts it
    assert late in [x.seq for x in step]


def test_a_page_shortage_takes_from_the_tenant_running_the_most():
    """alice runs three, bob one (started last). When pages run short, alice's newest gives up
    its pages, not bob's only one: before, the newest overall was the victim, so the tenant
    that admission had just let in was the first to lose its place."""
    led = Ledger(10, 4)   # 9 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    a = [make_seq(led, 8, i, "alice") for i in range(3)]   # 2 pages each, a 3rd to decode
    bob = make_seq(led, 8, 3, "bob")
    for s in (*a, bob):
        sch.add(s)
    fake_run(sch.schedule())
    assert led.num_available == 1 and all(s.state is State.DECODING for s in (*a, bob))
    step = sch.schedule()
    assert sch.num_preemptions == 1 and a[2].state is State.WAITING
    assert [x.seq for x in step] == [a[0], a[1], bob]
    led.check_consistency()


def test_the_heavy_tenants_own_sequence_gives_way_rather_than_a_light_one_behind_it():
    """Found in review: victims were taken only from behind the sequence that needs a page.
    When alice's last decode (bob's started after it) needed one, bob's only sequence was
    the one candidate. The sequence that needs the page is a candidate too: alice's own goes."""
    led = Ledger(9, 4)   # 8 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    a = [make_seq(led, 7, 0, "alice"), make_seq(led, 7, 1, "alice"), make_seq(led, 8, 2, "alice")]
    bob = make_seq(led, 7, 3, "bob")     # 2 pages each; only a[2] needs a 3rd to decode
    for s in (*a, bob):
        sch.add(s)
    fake_run(sch.schedule())
    assert led.num_available == 0
    step = sch.schedule()
    assert a[2].state is State.WAITING and bob.state is State.DECODING
    assert [x.seq for x in step] == [a[0], a[1], bob]
    led.check_consistency()



def test_a_request_waits_while_an_unservable_ones_pages_are_still_held():
    """Found in review: when the only running sequence could not grow (it goes to
    `unservable`, whose pages the engine frees after the schedule), admission saw nothing
    running and a full pool, and marked the next waiting request unservable too: aborted with
    kv_pool_exhausted although it fits once those pages return."""
    led = Ledger(9, 4)   # 8 usable pages
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    big = make_seq(led, 32, 0)            # all 8 pages; its first decode needs a 9th
    sch.add(big)
    fake_run(sch.schedule())
    small = make_seq(led, 4, 1)
    sch.add(small)
    assert sch.schedule() == []
    assert sch.unservable == [big] and small.state is State.WAITING
    big.on(Event.ABORT)                   # what the engine does with it (_end_unservable)
    led.free(big.owner, big.table)
    sch.unservable.clear()
    assert [x.seq for x in sch.schedule()] == [small]


def test_a_preempted_sequence_gets_its_own_cached_pages_back():
    """Preemption publishes the victim's whole pages, generated ones too, to its own cache
    scope (as a finished request's are; the engine publishes a prompt's when its prefill ends)
    before they go back: they are evicted only if a grant needs them, so on its return it
    attaches what survived instead of recomputing it. Another tenant with the same tokens
    attaches none (I9)."""
    led = Ledger(13, 4)                    # 12 usable pages
    pc = PrefixCache(led)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100, prefix_cache=pc)
    a, b = make_seq(led, 16, 0), make_seq(led, 16, 1)   # 4 pages each, then growing
    b.prompt_ids = list(range(100, 116))
    for s in (a, b):
        sch.add(s)
    while not sch.num_preemptions:          # decodes grow until a page is short
        _run_written(led, pc, sch.schedule())
    assert b.state is State.WAITING and b.num_computed == 0 and not b.table
    other = make_seq(led, 0, 9, tenant="u")  # the same tokens in another tenant's scope
    other.prompt_ids = list(b.all_ids)
    assert pc.match(other.owner, other.cache_scope, other.all_ids, other.table) == 0
    forged = make_seq(led, 0, 10, tenant="u")   # the hash chain of b's scope: the ledger still refuses
    forged.prompt_ids, forged.cache_scope = list(b.all_ids), b.cache_scope
    assert pc.match(forged.owner, forged.cache_scope, forged.all_ids, forged.table) == 0
    sch.remove(a)                           # a finishes and gives back its pages
    led.free(a.owner, a.table)
    step = sch.schedule()
    assert [x.seq for x in step] == [b]
    # 6 whole pages were published; its last went to the grant that preempted it (a chain's
    # tail goes first), the other 5 come back: a generated page among them
    assert len(b.all_ids) == 25 and b.num_computed == 20 > len(b.prompt_ids)
    assert step[0].num_new == b.num_tokens - b.num_computed
    assert b.cached_tokens == 0             # usage counts the cache only for a first start
    led.check_consistency()


def _run_written(led, pc, step):
    """fake_run, with the ledger told what was written and a finished prefill published."""
    for x in step:
        led.mark_written(x.seq.owner, x.seq.table, x.seq.num_computed, x.seq.num_computed + x.num_new)
    fake_run(step)
    for x in step:
        if len(x.seq.output_ids) == 1:
            pc.publish(x.seq.owner, x.seq.cache_scope, x.seq.all_ids, x.seq.table, x.seq.num_computed)


def test_a_newcomer_starts_beside_a_long_prefill_and_the_step_stays_full():
    """A prompt that arrives while another's long prompt is prefilled starts in the next step,
    not once the whole long prompt is done. An attacker probe saw a 7000-token prompt hold every
    other tenant's first token for 11-18 s, and the delay told them the prompt's length. What
    the newcomer does not use of the room kept for it goes back to the long prompt."""
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    long = make_seq(led, 600, 0, tenant="carol")
    sch.add(long)
    step = sch.schedule()
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r0", 100)]
    fake_run(step)
    sch.add(make_seq(led, 5, 1, tenant="bob"))
    step = sch.schedule()
    assert sorted((s.seq.request_id, s.num_new) for s in step) == [("r0", 95), ("r1", 5)]
    for s in step:
        assert len(s.seq.table) * 4 >= s.seq.num_computed + s.num_new
    fake_run(step)
    step = sch.schedule()          # nobody waits: the long prompt has the budget beside the decode
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r1", 1), ("r0", 99)]
    led.check_consistency()


def _first_token_step(sch: Scheduler, seq: Sequence, limit: int = 100) -> int:
    """Steps (schedule + fake run) until seq decodes; each step checked to be full."""
    for k in range(1, limit + 1):
        work = sum(s.uncomputed for s in [*sch.running, *sch.waiting])
        step = sch.schedule()
        assert sum(s.num_new for s in step) == min(sch.token_budget, work)   # nothing left idle
        fake_run(step)
        if seq.state is State.DECODING:
            return k
    raise AssertionError(f"{seq.request_id} still prefills after {limit} steps")


def test_another_tenants_prompt_beside_a_long_one_gets_an_equal_share_not_the_leftovers():
    """Running prefills of different tenants share each step's prefill room: a 60-token
    prompt (over the quarter kept for newcomers) of bob's behind carol's 3,000-token one took
    the quarter in its first step and then waited for all of carol's prompt (30 steps: a
    600-token prompt behind a 7,000-token one on the 2,048 budget, ~4 s on a 2-core CPU, and
    its wait told bob the other prompt's length). Now it has half the room: 2 steps. What it
    leaves of its half goes to carol's prompt in the same step."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    carol = make_seq(led, 3000, 0, tenant="carol")
    sch.add(carol)
    fake_run(sch.schedule())
    bob = make_seq(led, 60, 1, tenant="bob")
    sch.add(bob)
    assert _first_token_step(sch, bob) == 2
    step = sch.schedule()      # bob decodes; carol has the rest of the budget again
    assert [(s.seq.request_id, s.num_new) for s in step] == [("r1", 1), ("r0", 99)]
    led.check_consistency()


def test_one_tenants_prompts_keep_arrival_order():
    """The shares are between tenants: a tenant's own prompt behind its long one waits for it
    (the room kept for newcomers aside), as before."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    first = make_seq(led, 600, 0, tenant="carol")
    sch.add(first)
    fake_run(sch.schedule())
    second = make_seq(led, 60, 1, tenant="carol")
    sch.add(second)
    assert _first_token_step(sch, second) == 6   # 25 at its start, its 35 once the first 600 are done


def test_capped_prompts_of_two_tenants_share_the_cap():
    """Under the cap (streams decode), the cap is shared too: the earlier capped prompt took
    all of it each step, and the later one's tenant waited for the whole prompt."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    _decoding(led, sch, 2)
    carol = make_seq(led, 600, 0, tenant="carol")
    sch.add(carol)
    fake_run(sch.schedule())
    bob = make_seq(led, 20, 1, tenant="bob")
    sch.add(bob)
    for _ in range(4):
        step = sch.schedule()
        assert sum(s.num_new for s in step if s.seq.state is State.PREFILLING) <= 12
        fake_run(step)
    assert bob.state is State.DECODING      # 3 at its start, then 6 a step: 4 steps, not 50
    led.check_consistency()


def test_four_capped_tenants_each_progress_while_a_request_waits():
    """Cap shares are of the cap's room after the queue's quarter: taken of the whole cap,
    three capped tenants took all the room left and a fourth got nothing until one of them was
    done (a review's scenario: a tenant at its running share keeps a request waiting)."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12,
                    tenant_running_share=0.25)
    streams = [make_seq(led, 1, 100 + k, tenant="e") for k in range(4)]    # e at its running share
    for s in streams:
        sch.add(s)
    fake_run(sch.schedule())
    for s in streams:
        s.first_token_at = time.perf_counter()
    for k, t in enumerate("abcd"):
        sch.add(make_seq(led, 600, k, tenant=t))
    sch.add(make_seq(led, 5, 50, tenant="e"))                                # waits: e holds its share
    got: Counter = Counter()
    for _ in range(30):
        step = sch.schedule()
        assert sum(s.num_new for s in step if s.seq.state is State.PREFILLING) <= 12
        got.update({s.seq.tenant: s.num_new for s in step if s.seq.state is State.PREFILLING})
        fake_run(step)
    assert min(got[t] for t in "abcd") >= 40, got     # each about its quarter of the 9 a step left


def test_shares_under_the_cap_are_of_the_caps_room_when_decodes_fill_the_budget():
    """Every prefill capped, most of the budget taken by decodes, a request waiting: the shares
    were of the whole budget's room less its quarter for the queue (20 - 25 tokens: 1 each),
    not of the cap's room, and the later tenant's 60-token prompt took 60 steps (review)."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=100, token_budget=100, prefill_budget_while_decoding=12,
                    tenant_running_share=0.8)
    _decoding(led, sch, 80)                           # tenant t: its running share
    carol, bob = make_seq(led, 600, 0, tenant="carol"), make_seq(led, 60, 1, tenant="bob")
    sch.add(carol)
    sch.add(bob)
    sch.add(make_seq(led, 5, 50))                     # t's next: waits (t holds its share)
    for _ in range(20):
        fake_run(sch.schedule())
    assert bob.state is State.DECODING                # ~4 of the cap's 9 a step


def test_a_tenant_skipped_for_its_share_gives_up_its_pages_before_another_tenant_does():
    """A prefill skipped this step (its tenant's share spent) holds pages and runs nothing: on
    a page shortage it is a victim like those behind, so the tenant running the most gives
    way. It was passed over as if scheduled, and the other tenant's prefill preempted itself,
    losing its computed KV (found in review)."""
    led = Ledger(400, 4)
    sch = Scheduler(led, max_num_seqs=3, token_budget=100)
    c1, c2, b1 = make_seq(led, 1000, 0, tenant="carol"), make_seq(led, 1000, 1, tenant="carol"), \
        make_seq(led, 1000, 2, tenant="bob")
    for s in (c1, c2, b1):
        sch.add(s)
    for _ in range(3):
        fake_run(sch.schedule())
    hog = BlockTable()
    led.allocate(Owner(led.tenant_id("hog"), Sequence.next_number()), led.num_available - 20, hog)
    step = sch.schedule()
    assert [s.request_id for s in sch.waiting] == ["r1"], [s.request_id for s in sch.waiting]   # carol's second
    assert {s.seq.request_id for s in step} == {"r0", "r2"} and b1.num_computed > 0
    led.check_consistency()


def test_what_a_share_leaves_goes_back_as_far_as_the_free_pages_hold_it():
    """The give-back took a prefill's whole leftover or nothing: with 24 free pages a step
    used 70 of its 100 tokens (found in review). It now takes the part the pages hold."""
    led = Ledger(76, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    carol = make_seq(led, 3000, 0, tenant="carol")
    sch.add(carol)
    fake_run(sch.schedule())
    bob = make_seq(led, 45, 1, tenant="bob")
    sch.add(bob)
    fake_run(sch.schedule())
    step = sch.schedule()
    assert sum(s.num_new for s in step) > 90 and sch.num_preemptions == 0, [(s.seq.request_id, s.num_new) for s in step]
    led.check_consistency()


def test_what_the_queue_leaves_goes_back_to_the_tenants_evenly():
    """A request waits that cannot start (its tenant holds its running share), so a quarter of
    each step is kept for the queue and comes back unused; it went to the earliest tenant's
    prompt (carol 63, bob 37 tokens a step). Now each tenant takes an equal part of it, and a
    tenant that cannot use its part leaves it to the others in the same step."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=4, token_budget=100, tenant_running_share=0.25)
    carol, bob = make_seq(led, 3000, 0, tenant="carol"), make_seq(led, 3000, 1, tenant="bob")
    sch.add(carol)
    sch.add(bob)
    sch.add(make_seq(led, 50, 2, tenant="carol"))     # waits: carol holds her one running slot
    for _ in range(2):   # carol's prompt starts, then bob's in the queue's quarter
        fake_run(sch.schedule())
    for _ in range(3):
        step = sch.schedule()
        got = {s.seq.tenant: s.num_new for s in step}
        assert got == {"carol": 50, "bob": 50} and len(step) == 2, got
        fake_run(step)
    short = make_seq(led, 4, 3, tenant="dave")        # near done: the rest of its part goes to the others
    sch.add(short)
    fake_run(sch.schedule())
    step = sch.schedule()
    got = {s.seq.tenant: s.num_new for s in step if s.seq.state is State.PREFILLING}
    assert sum(s.num_new for s in step) == 100 and abs(got["carol"] - got["bob"]) <= 1, got
    led.check_consistency()


def test_under_the_cap_what_is_left_of_it_goes_back_to_the_tenants_evenly():
    """The same while a stream decodes: the cap (100) is the limit, not the budget (2,048).
    Equal parts of the tokens left let the first tenant take all that was left of the cap
    (63/37 again, found in review); each round now shares what is left of the cap too."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=2048, prefill_budget_while_decoding=100,
                    tenant_running_share=0.125)
    _decoding(led, sch, 1)
    carol, bob = make_seq(led, 3000, 0, tenant="carol"), make_seq(led, 3000, 1, tenant="bob")
    for seq in (carol, bob, make_seq(led, 50, 2, tenant="carol")):   # the last waits: carol holds her slot
        sch.add(seq)
    for _ in range(2):
        fake_run(sch.schedule())
    for _ in range(3):
        step = sch.schedule()
        got = {s.seq.tenant: s.num_new for s in step if s.seq.state is State.PREFILLING}
        assert got == {"carol": 50, "bob": 50}, got
        fake_run(step)
    led.check_consistency()


def test_a_newcomer_gets_a_share_of_the_cap_beside_a_long_capped_prefill():
    """While streams decode, a prompt that arrived after them is capped; one arriving behind
    it gets a share of that cap too, not the leftovers of a 60-token prompt's five steps."""
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    _decoding(led, sch, 2)
    sch.add(make_seq(led, 60, 0))
    fake_run(sch.schedule())
    sch.add(make_seq(led, 2, 1))
    step = sch.schedule()
    # the two decodes, then the cap's 12 prefill tokens: the newcomer's 2 and the long one's 10
    assert sorted((s.seq.request_id, s.num_new) for s in step[2:]) == [("r0", 10), ("r1", 2)]


def test_a_capped_newcomer_starts_beside_a_long_uncapped_prefill():
    """A long prompt that came in a burst is not capped; once streams decode, a prompt arriving
    behind it is. The cap counted the burst's chunk too, so the newcomer's room stayed 0 until
    the long prompt was done (found in review: the 11-18 s first token again, with the default
    cap on)."""
    led = Ledger(4096, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    first, long = make_seq(led, 1, 1), make_seq(led, 2000, 0)
    sch.add(first)
    sch.add(long)
    fake_run(sch.schedule())
    first.first_token_at = time.perf_counter()      # it streams now; the long prompt was already there
    assert first.state is State.DECODING and long.state is State.PREFILLING
    late = make_seq(led, 5, 2)
    sch.add(late)
    step = sch.schedule()
    assert ("r2", 5) in [(s.seq.request_id, s.num_new) for s in step]
    # the cap bounds what the capped prompts add to the step: the late one's 5 here
    assert sum(s.num_new for s in step if s.seq.arrival > first.first_token_at) <= 12
    led.check_consistency()


def test_one_tenant_holds_at_most_its_share_of_the_running_slots():
    """A fairness probe: a tenant's 16 requests of n=16 took all 256 running slots, nothing
    running is preempted for another tenant, and that tenant's first token waited 132-144 s.
    With a share of 3/4, a quarter of the slots stays free for the others: alice fills her 6
    of 8, the rest of hers wait; bob's request, arriving later, starts in the next step."""
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=1000, tenant_running_share=0.75)
    for i in range(12):
        sch.add(make_seq(led, 2, i, tenant="alice"))
    fake_run(sch.schedule())
    assert len(sch.running) == 6 and len(sch.waiting) == 6
    fake_run(sch.schedule())
    assert len(sch.running) == 6    # her share: two slots stay free though she waits
    bob = make_seq(led, 2, 99, tenant="bob")
    sch.add(bob)
    fake_run(sch.schedule())
    assert bob in sch.running and len(sch.running) == 7
    # without a tenants file (share 1.0) one tenant may take every slot, as before
    alone = Scheduler(Ledger(256, 4), max_num_seqs=8, token_budget=1000)
    for i in range(12):
        alone.add(make_seq(alone.ledger, 2, i, tenant="alice"))
    fake_run(alone.schedule())
    assert len(alone.running) == 8


def test_a_bursts_prompt_is_capped_once_another_tenants_stream_decodes():
    """A fairness probe: a tenant's burst of two ~7,500-token prompts into an idle engine kept
    the whole budget (the burst exemption) while another tenant's stream, begun just after,
    waited 2-4 s for each token. The burst's own streams may wait for it; another's may not."""
    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    burst = [make_seq(led, 300, i, tenant="heavy") for i in range(2)]
    light = make_seq(led, 1, 9, tenant="light")
    sch.add(light)
    for s in burst:
        sch.add(s)
    step = sch.schedule()   # idle: the whole budget, the light prompt beside the burst
    fake_run(step)
    light.first_token_at = time.perf_counter()
    assert light.state is State.DECODING
    step = sch.schedule()
    prefill = sum(s.num_new for s in step if s.seq.state is not State.DECODING)
    assert light in [s.seq for s in step] and prefill <= 12, [(s.seq.request_id, s.num_new) for s in step]


def test_metrics_show_which_tenant_holds_the_slots_and_who_waits():
    """The fairness probe's operator saw 256 running and 1 waiting, and could not tell whose:
    kvfence_tenant_sequences{tenant,state} says it (from Scheduler.sequences_by_tenant)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvfence.server.metrics import _EngineCollector

    led = Ledger(256, 4)
    sch = Scheduler(led, max_num_seqs=4, token_budget=1000, tenant_running_share=0.75)
    for i in range(5):
        sch.add(make_seq(led, 2, i, tenant="heavy"))
    fake_run(sch.schedule())
    sch.add(make_seq(led, 2, 9, tenant="light"))
    assert sch.sequences_by_tenant() == {"heavy": {"running": 3, "waiting": 2}, "light": {"running": 0, "waiting": 1}}
    reg = CollectorRegistry()
    reg.register(_EngineCollector(SimpleNamespace(state="ready", facts=None, snapshot={
        "running": 3, "waiting": 3, "sequences_by_tenant": sch.sequences_by_tenant()})))
    got = {(s.labels["tenant"], s.labels["state"]): s.value
           for fam in text_string_to_metric_families(generate_latest(reg).decode())
           if fam.name == "kvfence_tenant_sequences" for s in fam.samples}
    assert got == {("heavy", "running"): 3, ("heavy", "waiting"): 2, ("light", "running"): 0, ("light", "waiting"): 1}


def test_another_tenants_waiting_request_caps_a_prefill_that_runs_alone():
    """One tenant's long prompts run with the whole budget while nothing streams; a request of
    another tenant that arrives waits for the step in progress and the next, so the next is
    kept to the cap (a side-channel probe: eight 4,000-token prompts held another tenant's first
    token 3-7 s). The same tenant's own newcomer does not cap it."""
    led = Ledger(512, 4)
    sch = Scheduler(led, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    long = make_seq(led, 400, 0, tenant="bob")
    sch.add(long)
    fake_run(sch.schedule())                       # a burst into an idle engine: the whole budget
    sch.add(make_seq(led, 40, 1, tenant="bob"))
    step = sch.schedule()
    assert sum(s.num_new for s in step) == 100     # bob's own newcomer: nothing capped
    fake_run(step)
    carol = make_seq(led, 5, 2, tenant="carol")
    sch.add(carol)
    step = sch.schedule()
    got = {s.seq.request_id: s.num_new for s in step}
    assert got["r2"] == 5 and got["r0"] + got.get("r1", 0) <= 12, got
    fake_run(step)
    step = sch.schedule()                          # carol streams: bob stays capped beside her
    assert sum(s.num_new for s in step if s.seq.tenant == "bob") <= 12
    led.check_consistency()


def test_a_request_that_cannot_start_caps_nobody_and_newcomers_start_uncapped():
    """Review catches: a tenant at its running share kept one request waiting, and that held
    every other tenant's prefill to the cap while its own ran uncapped; and the rule capped the
    newcomers it is for (two tenants' arrivals into an idle engine got 12 of a 100-token step)."""
    led = Ledger(1024, 4)
    sch = Scheduler(led, max_num_seqs=4, token_budget=100, prefill_budget_while_decoding=12,
                    tenant_running_share=0.5)
    b = make_seq(led, 400, 0, tenant="b")
    sch.add(b)
    fake_run(sch.schedule())
    for i in range(3):                                   # a holds its share of 2; its third waits
        sch.add(make_seq(led, 400, 1 + i, tenant="a"))
    for _ in range(3):
        step = sch.schedule()
        fake_run(step)
    assert sum(1 for s in sch.running if s.tenant == "a") == 2 and len(sch.waiting) == 1
    step = sch.schedule()
    assert {s.seq.request_id: s.num_new for s in step}.get("r0", 0) > 12   # b is not held to the cap by it
    led2 = Ledger(1024, 4)
    idle = Scheduler(led2, max_num_seqs=16, token_budget=100, prefill_budget_while_decoding=12)
    for i, t in enumerate(("a", "a", "c", "c")):
        idle.add(make_seq(led2, 40, 10 + i, tenant=t))
    assert sum(s.num_new for s in idle.schedule()) == 100


def test_a_choice_waits_for_its_leads_prefill_and_others_pass_it():
    """n > 1: every choice is admitted at once, but the others of a prompt start only after its
    first has computed the prompt (so they attach its pages); a waiting choice holds up nobody."""
    led = Ledger(64, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    lead, sib, other = make_seq(led, 9, 0), make_seq(led, 9, 1), make_seq(led, 3, 2, tenant="u")
    sib.after = lead
    for s in (lead, sib, other):
        sch.add(s)
    step = sch.schedule()
    # room for all three, but the choice waits for its lead; the other tenant's request does not
    assert sorted(s.seq.request_id for s in step) == ["r0", "r2"]
    assert sib.state is State.WAITING and sib.waits_for_lead
    fake_run(step)   # the lead sampled its first token: the prompt's pages are computed
    step = sch.schedule()
    assert "r1" in [s.seq.request_id for s in step]
    assert sib.after is None   # let go of once started


def test_a_choice_whose_lead_ended_starts_on_its_own():
    led = Ledger(64, 4)
    sch = Scheduler(led, max_num_seqs=8, token_budget=100)
    lead, sib = make_seq(led, 9, 0), make_seq(led, 9, 1)
    sib.after = lead
    sch.add(sib)
    assert sch.schedule() == [] and sib.waits_for_lead   # its lead waits (not in this scheduler yet)
    lead.on(Event.ABORT)
    assert [s.seq.request_id for s in sch.schedule()] == ["r1"]


def test_a_step_budget_under_the_cap_still_runs_prefills_beside_a_waiting_request():
    """The PD simulation's n > 1 campaigns found a node that never moved again: a step budget
    (--max-num-batched-tokens 8) under the prefill cap (256), another tenant's request waiting
    for pages, and the running prefills' room taken as the budget less a quarter of the cap
    (8 - 64): none of them ran nor gave up its pages, and the waiting request could not start.
    The queue's quarter is of the room a step can have: the budget where the cap is above it."""
    led = Ledger(10, 4)   # 9 usable pages
    sch = Scheduler(led, max_num_seqs=16, token_budget=8, prefill_budget_while_decoding=256)
    for i, (pages, computed) in enumerate(((5, 20), (4, 16))):   # a's two prompts, part computed, hold the pool
        s = make_seq(led, 40, i, tenant="a")
        led.allocate(s.owner, pages, s.table)
        s.num_computed = computed
        s.on(Event.SCHEDULE)
        sch.running.append(s)
    sch.add(make_seq(led, 14, 2, tenant="c"))
    before = sch.num_preemptions
    step = sch.schedule()
    assert step or sch.num_preemptions > before, "nothing ran and nothing gave up its pages: the node never moves"
    led.check_consistency()
    # and the running prefills keep three quarters of a budget under the cap, not budget - cap / 4
    led2 = Ledger(1024, 4)
    sch2 = Scheduler(led2, max_num_seqs=16, token_budget=128, prefill_budget_while_decoding=256)
    sch2.add(make_seq(led2, 4000, 10, tenant="a"))
    fake_run(sch2.schedule())
    sch2.add(make_seq(led2, 40, 11, tenant="c"))
    step = sch2.schedule()   # c's request takes the queue's quarter of the step, a the rest
    assert {s.seq.request_id: s.num_new for s in step} == {"r10": 96, "r11": 32}
