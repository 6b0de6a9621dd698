"""Campaigns of the PD simulation: many seeds, many request lives, one summary.

    python -m kvfence.sim --lives 100000 --seeds 100           # a campaign (lives split over the seeds)
    python -m kvfence.sim --seed 1234 --lives 1000 --trace      # replay one seed, printing every step
    python -m kvfence.sim --seeds 20 --fault skip_row_auth      # show a fault point being caught
    python -m kvfence.sim --fleet --lives 100000 --seeds 100    # fleets of 2-4 x 2-4 nodes
    python -m kvfence.sim --scopes --lives 100000 --seeds 100   # 1-3 routers, names given to new parties
    python -m kvfence.sim --choices --lives 100000 --seeds 100  # requests for n > 1 choices (with --fleet too)
    python -m kvfence.sim --sched --lives 100000 --seeds 100    # engines' cap, shares, queues and page size drawn

Each seed draws its own configuration (pool and buffer sizes, concurrency, fault rates; see
SimConfig.draw) unless --fixed. It prints a line per seed, then the count of lives, wall
time, lives/s, per-outcome counts and every failing seed with its invariant; the exit
status is 1 when any seed failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

from kvfence.arg_types import at_least_one


def _one(job: dict) -> dict:
    """Run one seed (in this process or a worker); never raises."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from contextlib import ExitStack

    from kvfence import faults
    from kvfence.sim.cluster import SimFailure, simulate

    t0 = time.perf_counter()
    with ExitStack() as stack:
        if job["faults"]:
            stack.enter_context(faults.injected(*job["faults"]))
        try:
            r = simulate(job["seed"], job["lives"], draw=not job["fixed"], known_bugs=tuple(job["known_bugs"]),
                         trace_all=job["trace"], fleet=job["fleet"], scopes=job["scopes"],
                         choices=job["choices"], sched=job["sched"])
            return {"seed": job["seed"], "ok": True, "lives": r.lives, "steps": r.steps, "seconds": r.seconds,
                    "outcomes": dict(r.outcomes), "stats": dict(r.stats)}
        except SimFailure as e:
            return {"seed": job["seed"], "ok": False, "lives": job["lives"], "steps": e.step,
                    "seconds": time.perf_counter() - t0, "invariant": e.invariant, "message": e.message,
                    "report": e.report(), "outcomes": {}, "stats": {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfence sim", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--lives", type=at_least_one, default=1000,
                    help="request lives in all (split evenly over the seeds)")
    ap.add_argument("--seeds", type=at_least_one, default=1, help="how many seeds, starting at --first-seed")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="run exactly this one seed (with --lives lives)")
    ap.add_argument("--fleet", action="store_true",
                    help="fleets: 2-4 prefill x 2-4 decode nodes behind the router's fleet logic, with node kills, "
                         "restarts, drains and misconfigured (refused) nodes")
    ap.add_argument("--scopes", action="store_true",
                    help="1-3 router processes stamping requests; tenants' names given to new parties, reloads "
                         "whose forget messages nodes may miss, router restarts, idle routers' scopes retired; checks "
                         "that no cache scope ever serves two parties")
    ap.add_argument("--choices", action="store_true",
                    help="requests for n > 1 choices: each later choice prefills once its first one's prompt is held, "
                         "decode reserves a request's choices together, and one that fails (before admission or while "
                         "the others generate) ends the request (the server aborts the others)")
    ap.add_argument("--sched", action="store_true",
                    help="draw the engines' scheduling settings too: the prefill cap while decoding (none, 4, "
                         "16, 64, 256 tokens), each tenant's share of the running slots (all, 3/4, 1/2, 1/4) and each "
                         "node's queue (max_waiting 1024, 16, 4, 2: refusals for load) and the page size (4, 8, 16)")
    ap.add_argument("--fixed", action="store_true", help="SimConfig defaults instead of a configuration drawn per seed")
    ap.add_argument("--fault", action="append", default=[], help="enable a kvfence.faults point (repeatable)")
    ap.add_argument("--known-bugs", default="",
                    help="comma-separated names from kvfence.sim.cluster.KNOWN_BUGS whose symptom to excuse")
    ap.add_argument("--trace", action="store_true", help="print every simulation step as it happens")
    ap.add_argument("--jobs", type=at_least_one, default=1, help="worker processes")
    ap.add_argument("--keep-going", action="store_true", help="run every seed even after a failure")
    a = ap.parse_args(argv)

    from kvfence.faults import FaultConfigError
    from kvfence.faults import parse as parse_faults
    from kvfence.sim.cluster import KNOWN_BUGS

    for f in a.fault:   # a point, point:ARG, or a comma list of them
        try:
            parse_faults(f)
        except FaultConfigError as e:
            ap.error(f"--fault {f!r}: {str(e).replace(' in KVFENCE_TEST_FAULTS', '')}")

    if a.fixed and (a.fleet or a.scopes or a.choices or a.sched):
        ap.error("--fixed runs SimConfig's defaults: --fleet, --scopes, --choices and --sched choose what a seed draws")
    known = [k for k in a.known_bugs.split(",") if k]
    for k in known:
        if k not in KNOWN_BUGS:
            ap.error(f"unknown --known-bugs name {k!r}; known: {', '.join(KNOWN_BUGS)}")
    seeds = [a.seed] if a.seed is not None else list(range(a.first_seed, a.first_seed + a.seeds))
    per = max(1, a.lives // len(seeds))
    jobs = [{"seed": s, "lives": per + (1 if i < a.lives - per * len(seeds) else 0), "fixed": a.fixed,
             "faults": a.fault, "known_bugs": known, "trace": a.trace, "fleet": a.fleet,
             "scopes": a.scopes, "choices": a.choices, "sched": a.sched}
            for i, s in enumerate(seeds)]
    print(f"kvfence simulation: {len(seeds)} seed(s), {sum(j['lives'] for j in jobs)} request lives"
          f"{', faults ' + ','.join(a.fault) if a.fault else ''}{', excusing ' + ','.join(known) if known else ''}",
          flush=True)
    t0 = time.perf_counter()
    results, failed = [], []
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(a.jobs) as pool:
            for r in pool.map(_one, jobs):
                results.append(r)
                _line(r, t0)
                if not r["ok"]:
                    failed.append(r)
    else:
        for job in jobs:
            r = _one(job)
            results.append(r)
            _line(r, t0)
            if not r["ok"]:
                failed.append(r)
                if not a.keep_going:
                    break
    wall = time.perf_counter() - t0
    lives = sum(r["lives"] for r in results)
    outcomes, stats = Counter(), Counter()
    for r in results:
        outcomes.update(r["outcomes"])
        stats.update(r["stats"])
    print(f"\n{lives} request lives over {len(results)} seed(s) in {wall:.1f} s: {lives / wall:.1f} lives/s, "
          f"{sum(r['steps'] for r in results)} steps")
    print("outcomes:")
    for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {v:8d}  {k}")
    kinds = ("transport_", "crash", "known_bug", "adversary_", "drain", "routed_", "fleet_", "scope_", "router_",
             "choice", "decode_choices", "overloaded_")
    interesting = {k: v for k, v in stats.items() if v and (k.startswith(kinds)
                                                            or k.endswith(("fences", "late_notices", "stale_notices",
                                                                           "verify_failed", "leases_expired",
                                                                           "pulls_given_up", "never_settled")))}
    if interesting:
        print("events:")
        for k, v in sorted(interesting.items()):
            print(f"  {v:8d}  {k}")
    if failed:
        print(f"\nFAILED seeds: {', '.join(str(r['seed']) for r in failed)}")
        for r in failed:
            print()
            print(r["report"])
        return 1
    print("\nresult: every invariant held after every step of every seed")
    return 0


def _line(r: dict, t0: float) -> None:
    status = "ok" if r["ok"] else f"FAILED {r['invariant']}: {r['message']}"
    print(f"seed {r['seed']:6d}: {r['lives']:6d} lives, {r['steps']:7d} steps, {r['seconds']:6.1f} s  {status}  "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    sys.exit(main())
