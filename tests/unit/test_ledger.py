"""The ownership ledger on its own (I1, I2, I3, I6, I7), without a model."""
from __future__ import annotations

import numpy as np
import pytest

from kvfence.kv.ledger import (
    NULL_PAGE,
    BlockTable,
    Ledger,
    LedgerError,
    Owner,
    PageState,
    PoolExhausted,
    ReadRequest,
    ScrubPolicy,
)


def owner(led: Ledger, tenant: str, req: int) -> Owner:
    return Owner(led.tenant_id(tenant), req)


def test_grant_records_one_owner_and_free_bumps_epoch():
    led = Ledger(8, 4)
    a = owner(led, "t1", 1)
    t = BlockTable()
    led.allocate(a, 3, t)
    assert len(t) == 3 and NULL_PAGE not in t.pages
    assert led.state[NULL_PAGE] == PageState.RESERVED_NULL
    for p, e in zip(t.pages, t.epochs):
        assert led.state[p] == PageState.OWNED and led.owner_request[p] == 1 and led.epoch[p] == e
    pages = list(t.pages)
    led.free(a, t)
    assert len(t) == 0
    for p in pages:
        assert led.state[p] == PageState.FREE and led.owner_request[p] == -1 and led.epoch[p] == 1
    led.check_consistency()


def test_allocation_is_all_or_nothing():
    led = Ledger(4, 4)  # 3 usable pages
    t = BlockTable()
    with pytest.raises(PoolExhausted):
        led.allocate(owner(led, "t", 1), 4, t)
    assert len(t) == 0 and led.num_free == 3


def test_free_uses_the_ledger_not_the_table():
    """A corrupted table cannot leak pages nor free someone else's."""
    led = Ledger(8, 4)
    a, b = owner(led, "A", 1), owner(led, "B", 2)
    ta, tb = BlockTable(), BlockTable()
    led.allocate(a, 2, ta)
    led.allocate(b, 2, tb)
    ta.pages[0] = tb.pages[0]  # A's table now names B's page
    led.free(a, ta)
    assert all(led.state[p] == PageState.OWNED and led.owner_request[p] == 2 for p in tb.pages)
    assert led.num_free == 5  # A's two pages came back, B's stayed
    led.check_consistency()


def test_authorize_flags_wrong_owner_epoch_and_unwritten():
    led = Ledger(16, 4)
    a, b = owner(led, "A", 1), owner(led, "B", 2)
    ta, tb = BlockTable(), BlockTable()
    led.allocate(a, 2, ta)
    led.allocate(b, 2, tb)
    led.mark_written(a, ta, 0, 6)
    led.mark_written(b, tb, 0, 6)
    ok = led.authorize([ReadRequest(a, ta, 6, 1), ReadRequest(b, tb, 6, 1)])
    assert ok == []
    # wrong owner
    bad = BlockTable(list(ta.pages), list(ta.epochs))
    bad.pages[1] = tb.pages[1]
    bad.epochs[1] = tb.epochs[1]
    v = led.authorize([ReadRequest(a, bad, 6, 1), ReadRequest(b, tb, 6, 1)])
    assert [(x.index, x.invariant, x.page) for x in v] == [(0, "I2", tb.pages[1])]
    # stale epoch
    stale = BlockTable(list(ta.pages), [e - 1 for e in ta.epochs])
    assert led.authorize([ReadRequest(a, stale, 6, 1)])[0].invariant == "I2"
    # attending more than was written
    v = led.authorize([ReadRequest(a, ta, 7, 1)])
    assert v[0].invariant == "I3" and v[0].page == ta.pages[1]
    # a table too short for the pass
    assert led.authorize([ReadRequest(a, ta, 6, 3)])[0].invariant == "I2"
    assert led.violations == {"I2": 3, "I3": 1}


def test_authorize_rejects_free_and_quarantined_pages():
    led = Ledger(8, 4)
    a = owner(led, "A", 1)
    t = BlockTable()
    led.allocate(a, 1, t)
    led.mark_written(a, t, 0, 4)
    copy = BlockTable(list(t.pages), list(t.epochs))
    led.free(a, t)
    assert led.authorize([ReadRequest(a, copy, 4, 0)])[0].invariant == "I2"  # freed: epoch moved on
    led.quarantine(copy.pages, "test")
    assert led.state[copy.pages[0]] == PageState.QUARANTINED
    assert copy.pages[0] not in led._free
    led.check_consistency()


def test_checks_can_be_switched_off_for_measurement_only():
    led = Ledger(8, 4)
    led.checks_enabled = False
    a = owner(led, "A", 1)
    assert led.authorize([ReadRequest(a, BlockTable([3], [9]), 4, 0)]) == []


def test_suspect_page_is_quarantined_when_its_owner_returns_it():
    led = Ledger(8, 4)
    b = owner(led, "B", 2)
    tb = BlockTable()
    led.allocate(b, 2, tb)
    led.quarantine([tb.pages[0]], "I2 violation")
    assert led.state[tb.pages[0]] == PageState.OWNED  # B keeps using its intact page
    p0, p1 = tb.pages
    led.free(b, tb)
    assert led.state[p0] == PageState.QUARANTINED and led.state[p1] == PageState.FREE
    led.release_quarantine([p0])
    assert led.state[p0] == PageState.FREE
    led.check_consistency()


def test_fence_keeps_pages_out_until_lifted():
    led = Ledger(8, 4)
    a = owner(led, "A", 1)
    t = BlockTable()
    led.allocate(a, 3, t)
    led.fence(a, t, "transfer in flight")  # no time bound: only an explicit lift frees them
    assert led.num_quarantined == 3 and led.num_free == 4 and led.fenced(a.request)
    with pytest.raises(PoolExhausted):
        led.allocate(a, 5, BlockTable())
    assert led.lift_expired_fences(now=1e18) == 0
    assert led.lift_fence(a.request) == 3
    assert led.num_free == 7 and not led.fenced(a.request)
    led.check_consistency()


def test_timed_fence_lifts_only_after_its_time():
    led = Ledger(8, 4)
    a, b = owner(led, "A", 1), owner(led, "B", 2)
    ta, tb = BlockTable(), BlockTable()
    led.allocate(a, 2, ta)
    led.allocate(b, 1, tb)
    led.fence(a, ta, "lease expired", until=100.0)
    led.fence(b, tb, "lease expired", until=200.0)
    assert led.next_fence_time() == 100.0
    assert led.lift_expired_fences(now=99.9) == 0 and led.num_quarantined == 3
    assert led.lift_expired_fences(now=100.0) == 2 and led.num_quarantined == 1
    assert led.lift_expired_fences(now=250.0) == 1 and led.num_fences == 0
    led.check_consistency()


def test_mark_written_refuses_pages_not_owned():
    led = Ledger(8, 4)
    a, b = owner(led, "A", 1), owner(led, "B", 2)
    tb = BlockTable()
    led.allocate(b, 1, tb)
    with pytest.raises(LedgerError):
        led.mark_written(a, tb, 0, 2)


def test_scrub_callback_gets_freed_pages_with_policy():
    calls = []
    led = Ledger(8, 4, scrub="zero-on-free", scrubber=lambda pages, pol: calls.append((sorted(pages), pol)))
    a = owner(led, "A", 1)
    t = BlockTable()
    led.allocate(a, 2, t)
    pages = sorted(t.pages)
    led.free(a, t)
    assert calls == [(pages, ScrubPolicy.ZERO)]
    with pytest.raises(ValueError):
        ScrubPolicy.parse("shred")


def test_random_operations_keep_the_ledger_consistent():
    rng = np.random.default_rng(0)
    led = Ledger(32, 4)
    live: dict[int, BlockTable] = {}
    for step in range(2000):
        op = rng.integers(4)
        if op == 0 or not live:
            r = int(step + 1)
            t = BlockTable()
            try:
                led.allocate(owner(led, f"t{r % 3}", r), int(rng.integers(1, 5)), t)
                live[r] = t
            except PoolExhausted:
                pass
        elif op == 1:
            r = int(rng.choice(list(live)))
            led.free(owner(led, f"t{r % 3}", r), live.pop(r))
        elif op == 2:
            led.quarantine([int(rng.integers(1, 32))], "random")
        else:
            q = np.flatnonzero(led.state == PageState.QUARANTINED)
            led.release_quarantine(q[: int(rng.integers(0, 3))])
        led.check_consistency()
        owned = sum(len(t) for t in live.values())
        assert led.num_owned == owned
        assert led.num_owned + led.num_free + led.num_quarantined == led.usable_pages


def test_shared_pages_are_read_only_scoped_and_refcounted():
    led = Ledger(8, 4)
    evicted = []
    led.on_evict = evicted.append
    a = owner(led, "A", 1)
    t = BlockTable()
    led.allocate(a, 2, t)
    led.mark_written(a, t, 0, 6)  # page 0 full, page 1 half
    p0, p1 = t.pages
    assert not led.publish(a, p1, t.epochs[1])  # not fully written: cannot be shared
    assert led.publish(a, p0, t.epochs[0])
    assert led.state[p0] == PageState.SHARED and led.refcount[p0] == 1
    # a request of the same scope may read it, not write it; another scope may do neither
    a2, b = owner(led, "A", 2), owner(led, "B", 3)
    ta2, tb = BlockTable(), BlockTable()
    assert led.attach(a2, p0, ta2) and not led.attach(b, p0, tb)
    led.allocate(a2, 1, ta2)
    assert led.authorize([ReadRequest(a2, ta2, 4, 1)]) == []
    assert led.authorize([ReadRequest(a2, ta2, 2, 1)])[0].detail.endswith("would write it")
    forged = BlockTable([p0], [int(led.epoch[p0])])
    assert led.authorize([ReadRequest(b, forged, 4, 0)])[0].invariant == "I2"
    led.free(a, t)
    led.free(a2, ta2)
    assert led.state[p0] == PageState.SHARED and led.refcount[p0] == 0 and led.num_available == 7
    led.check_consistency()
    # pressure evicts it: scrubbed, new epoch, the cache is told
    led.allocate(b, 7, BlockTable())
    assert evicted == [p0] and led.state[p0] == PageState.OWNED and led.counters["pages_evicted"] == 1
    led.check_consistency()


def test_a_retired_scopes_pages_leave_the_cache_now_or_when_their_last_reader_ends():
    """A tenant removed by a tenants-file reload: its cached pages are forgotten and scrubbed,
    an unread one at once, one a request still reads once that request ends; another scope's
    pages stay cached."""
    scrubbed: list[int] = []
    led = Ledger(8, 4, scrub="zero", scrubber=lambda pages, policy: scrubbed.extend(pages))
    evicted: list[int] = []
    led.on_evict = evicted.append
    cached = {}
    for name, req in (("A", 1), ("B", 2)):
        o, t = owner(led, name, req), BlockTable()
        led.allocate(o, 2, t)
        led.mark_written(o, t, 0, 8)
        for p, e in zip(t.pages, t.epochs, strict=True):
            assert led.publish(o, p, e)
        cached[name] = list(t.pages)
        led.free(o, t)
    reader, rt = owner(led, "A", 3), BlockTable()
    assert led.attach(reader, cached["A"][0], rt)           # A's first page is being read
    assert led.retire_scope("A") == 2 and led.retire_scope("nobody") == 0
    unread, read = cached["A"][1], cached["A"][0]
    assert sorted(evicted) == sorted([unread, read]) and scrubbed == [unread]   # both forgotten, one freed
    assert led.state[unread] == PageState.FREE and led.state[read] == PageState.SHARED
    assert not led.attach(owner(led, "A", 4), unread, BlockTable())
    # the name comes back under a new id, which attaches nothing of the old one's
    assert owner(led, "A", 5).tenant != reader.tenant and not led.attach(owner(led, "A", 5), read, BlockTable())
    assert not led.attach(Owner(reader.tenant, 7), read, BlockTable())   # nor does the old one, any more
    # a request of the removed tenant still running publishes nothing more under the old scope
    late, lt = Owner(reader.tenant, 6), BlockTable()
    led.allocate(late, 1, lt)
    led.mark_written(late, lt, 0, 4)
    assert not led.publish(late, lt.pages[0], lt.epochs[0])
    led.free(late, lt)
    led.check_consistency()
    before = len(scrubbed)
    led.free(reader, rt)                                    # its last reader ends: freed, not cached
    assert led.state[read] == PageState.FREE and scrubbed[before:] == [read]
    assert all(led.state[p] == PageState.SHARED for p in cached["B"])
    assert led.num_available == 7
    led.check_consistency()


def test_eviction_takes_a_cached_chains_tail_before_its_head():
    """A prefix is matched from its first page on, so evicting the head first would leave the
    rest of the chain unmatchable while it still held pages (found measuring preemption: the
    head went first, and a preempted request re-attached nothing)."""
    led = Ledger(8, 4)
    evicted = []
    led.on_evict = evicted.append
    a = owner(led, "A", 1)
    t = BlockTable()
    led.allocate(a, 3, t)
    led.mark_written(a, t, 0, 12)
    head, mid, tail = t.pages
    for p, e in zip(t.pages, t.epochs, strict=True):
        assert led.publish(a, p, e)
    led.free(a, t)
    assert led.num_free == 4
    led.allocate(owner(led, "B", 2), 5, BlockTable())   # needs one cached page
    assert evicted == [tail]
    led.allocate(owner(led, "B", 3), 1, BlockTable())
    assert evicted == [tail, mid] and led.state[head] == PageState.SHARED
    led.check_consistency()


def cache(led: Ledger, name: str, req: int, n: int) -> list[int]:
    """n pages of a request of tenant `name`, written, published to its scope, and let go of:
    cached, unreferenced (evictable)."""
    o, t = owner(led, name, req), BlockTable()
    led.allocate(o, n, t)
    led.mark_written(o, t, 0, 4 * n)
    for p, e in zip(t.pages, t.epochs, strict=True):
        assert led.publish(o, p, e)
    pages = list(t.pages)
    led.free(o, t)
    return pages


def test_a_grant_evicts_from_the_scope_that_caches_the_most_so_a_busy_tenant_cannot_flush_another():
    """Global LRU let one tenant's traffic flush every other tenant's cached prefixes (a
    probe saw a busy tenant hold ~96% of the pool). The scope with the most unreferenced
    cached pages gives one up, its least recent; a light tenant's older prefix stays."""
    led = Ledger(12, 4)
    evicted: list[int] = []
    led.on_evict = evicted.append
    light = cache(led, "light", 1, 2)          # the oldest cached pages in the pool
    busy = cache(led, "busy", 2, 3) + cache(led, "busy", 3, 3)
    assert led.num_free == 11 - 8
    led.allocate(owner(led, "busy", 4), 7, BlockTable())   # four cached pages must go
    assert len(evicted) == 4 and set(evicted) <= set(busy)
    assert all(led.state[p] == PageState.SHARED for p in light)
    led.check_consistency()
    # two scopes holding as many: the one whose page was used longest ago gives one up
    led.allocate(owner(led, "other", 5), 1, BlockTable())
    assert evicted[-1] == light[1] and led.state[light[0]] == PageState.SHARED   # a chain's tail first
    led.check_consistency()


def test_a_tie_between_scopes_evicts_the_least_recently_used_page():
    led = Ledger(6, 4)
    evicted: list[int] = []
    led.on_evict = evicted.append
    cached = {name: cache(led, name, req, 1)[0] for name, req in (("A", 1), ("B", 2))}
    reader, rt = owner(led, "A", 3), BlockTable()
    assert led.attach(reader, cached["A"], rt)
    led.free(reader, rt)                   # A's page is now the more recently used
    led.allocate(owner(led, "C", 4), 4, BlockTable())
    assert evicted == [cached["B"]]
    led.check_consistency()
