"""The simulation with router processes (SimConfig.draw(scopes=True)): 1-3 routers stamp
requests, the tenants file gives names to new parties, each router reloads in its own time
with forget messages nodes may miss, routers restart under new ids, nodes retire the
scopes of routers gone silent, and some queued retirements raise. The checker holds I9 by who sent what: one cache scope
serves one party, ever. Each defense has a mutant the checker catches."""
from __future__ import annotations

import functools

import pytest

import kvfence.engine.llm_engine as engine_mod
from kvfence.pd.scope_epochs import ScopeEpochs, ScopeGate, ScopeRetired
from kvfence.sim.cluster import SimFailure, simulate

SCOPE_SEEDS = (0, 4, 6)   # between them: 1 and 2 routers, restarts, lost forgets, stale stamps, idle routers,
#                           failed retirements and requests queued behind them
LIVES = 400


@functools.cache
def clean(seed: int):
    return simulate(seed, LIVES, scopes=True)


@pytest.mark.parametrize("seed", SCOPE_SEEDS)
def test_router_processes_and_new_parties_hold_every_invariant(seed):
    r = clean(seed)
    print(f"seed {seed}: {r.lives} lives, {r.steps} steps, {r.seconds:.1f} s; {dict(r.outcomes)}")
    assert sum(r.outcomes.values()) == LIVES


def test_the_scope_runs_cover_every_path():
    stats = sum((clean(s).stats for s in SCOPE_SEEDS), start=type(clean(0).stats)())
    for path in ("scope_retired_on_stamp", "scope_stale_stamp_refused", "scope_forget_delivered",
                 "scope_idle_routers_retired", "router_restarts", "scope_retire_failed", "scope_refused_unretired"):
        assert stats[path] > 0, path


def test_a_scope_run_replays_exactly():
    a, b = simulate(2, 150, scopes=True), simulate(2, 150, scopes=True)
    assert (a.digest, a.steps, a.outcomes, a.stats) == (b.digest, b.steps, b.outcomes, b.stats)


def caught(seeds=range(8)) -> SimFailure:
    for seed in seeds:
        try:
            simulate(seed, LIVES, scopes=True)
        except SimFailure as e:
            print(e.report())
            return e
    pytest.fail("no seed caught the mutant")


def test_a_node_that_does_not_retire_on_a_newer_stamp_is_caught_as_I9(monkeypatch):
    """A node that missed the forget message admits the name's new party into the old one's scope."""
    admit = ScopeEpochs.admit
    monkeypatch.setattr(ScopeEpochs, "admit", lambda self, stamp, tenant: admit(self, stamp, tenant) and False)
    e = caught()
    assert e.invariant == "I9" and "which served party" in e.message


def test_a_node_that_admits_stale_stamps_is_caught_as_I9(monkeypatch):
    """A request sent before a reload the node already carried out lands in the new party's scope."""
    admit = ScopeEpochs.admit

    def stale_too(self, stamp, tenant):
        try:
            return admit(self, stamp, tenant)
        except ScopeRetired:
            return False
    monkeypatch.setattr(ScopeEpochs, "admit", stale_too)
    e = caught()
    assert e.invariant == "I9" and "which served party" in e.message


def test_scopes_not_kept_apart_per_router_process_are_caught_as_I9(monkeypatch):
    """Routers reload in their own time (and a restarted one numbers its reloads anew): keyed
    by the name alone, one router's old party and another's new one share a scope."""
    name = engine_mod.scope_name
    monkeypatch.setattr(engine_mod, "scope_name", lambda tenant, public=None, router=None: name(tenant, public))
    e = caught()
    assert e.invariant == "I9"


def test_a_node_that_runs_requests_queued_behind_a_failed_retirement_is_caught_as_I9(monkeypatch):
    """The retirement ahead of a request raised: run anyway, the request joins the old party's scope."""
    monkeypatch.setattr(ScopeGate, "unretired", staticmethod(lambda behind: False))
    e = caught()
    assert e.invariant == "I9" and "which served party" in e.message


def test_a_node_that_forgets_a_failed_retirement_is_caught_as_I9(monkeypatch):
    """Not marked to retire again, the pair's next request of the same epoch is admitted as retired."""
    monkeypatch.setattr(ScopeEpochs, "retire_again", lambda self, router, tenant, epoch: None)
    e = caught()
    assert e.invariant == "I9" and "which served party" in e.message
