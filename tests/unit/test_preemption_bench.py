"""The preemption count (kvfence/bench/preemption.py) on the real engine and the tiny model:
every request finishes, the pool is small enough to preempt, and what comes back from the
request's own cache is not computed twice."""
from __future__ import annotations

from kvfence.bench.preemption import Workload, run


def test_a_tight_pool_preempts_and_recomputes_less_than_it_dropped():
    r = run(Workload(requests=8, prompt=40, output=40, pages=40))
    assert r["finished"] == 8 and r["preemptions"] > 0
    assert r["computed"] - r["needed"] > 0          # preemption costs something
    assert r["cache_hit_tokens"] > 0                # ...less than all: they re-attach their own pages
    roomy = run(Workload(requests=8, prompt=40, output=40, pages=400))
    assert roomy["preemptions"] == 0 and roomy["computed"] == roomy["needed"]
