"""The simulation with fleets (SimConfig.draw(fleet=True)): 2-4 prefill and 2-4 decode nodes
behind the router's own fleet logic (kvfence/pd/fleet.py, capacity.py, the retry and redo
rules of router.py), with node kills, restarts, drains and restarts that come up with a pool
below the advertised context; I1-I9 after every step on every node. Each defense of the fleet has a
mutant the checker catches."""
from __future__ import annotations

import functools

import pytest

import kvfence.pd.fleet as fleet_mod
import kvfence.sim.cluster as cluster_mod
from kvfence import faults
from kvfence.sim.cluster import SimFailure, simulate

FLEET_SEEDS = (1, 6)
LIVES = 400


@functools.cache
def clean(seed: int):
    return simulate(seed, LIVES, fleet=True, misconfigured=0.3)


@pytest.mark.parametrize("seed", FLEET_SEEDS)
def test_a_fleet_holds_every_invariant(seed):
    r = clean(seed)
    print(f"seed {seed}: {r.lives} lives, {r.steps} steps, {r.seconds:.1f} s; {dict(r.outcomes)}")
    assert sum(r.outcomes.values()) == LIVES
    assert r.stats["fleet_nodes"] >= 4
    # the fleet's paths ran: several nodes of each role served, nodes were drained and
    # restarted, and restarts below the advertised context were refused
    assert r.stats["routed_prefill"] > 0 and r.stats["routed_decode"] > 0
    assert r.stats["drained_prefill"] + r.stats["drained_decode"] > 0


def test_the_fleet_runs_cover_refused_and_unchecked_nodes():
    stats = sum((clean(s).stats for s in FLEET_SEEDS), start=type(clean(1).stats)())
    assert stats["fleet_prefill_refused"] + stats["fleet_decode_refused"] > 0
    assert stats["fleet_unchecked_boot_refused"] > 0
    assert stats["crash_prefill"] + stats["crash_decode"] > 0
    # a node that failed a handoff before its client saw anything: the request was done again
    # without it (router.may_redo), and the checker held every invariant through the redo
    assert stats["redone"] > 0


def test_a_fleet_replays_exactly():
    a = simulate(3, 150, fleet=True)
    b = simulate(3, 150, fleet=True)
    assert (a.digest, a.steps, a.outcomes, a.stats) == (b.digest, b.steps, b.outcomes, b.stats)


def caught(seeds=range(6)) -> SimFailure:
    for seed in seeds:
        try:
            simulate(seed, 1500, fleet=True, misconfigured=0.5)
        except SimFailure as e:
            print(e.report())
            return e
    pytest.fail("no seed caught the mutant")


def test_a_restarted_node_serving_before_its_check_is_caught_as_I8():
    """Without the boot check a node serves requests in the gap between its restart and the
    monitor's next poll, even though its new pool is below the advertised context."""
    with faults.injected("skip_boot_check"):
        e = caught()
    assert e.invariant == "I8" and "must be refused" in e.message


def test_a_fleet_that_does_not_refuse_small_nodes_is_caught_as_I8(monkeypatch):
    monkeypatch.setattr(fleet_mod, "node_problems", lambda *a, **k: [])
    e = caught()
    assert e.invariant == "I8"


def test_a_drain_that_exits_while_a_request_needs_the_node_is_caught(monkeypatch):
    monkeypatch.setattr(cluster_mod, "drained_idle", lambda snapshot: True)
    e = caught()
    assert e.invariant == "drain" and "still needed it" in e.message
