"""Latency summaries shared by the offline and HTTP benchmarks."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99/mean of durations in seconds, reported in milliseconds."""
    if not values:
        return {}
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] * 1e3  # noqa: E731
    return {"p50": round(at(0.5), 2), "p90": round(at(0.9), 2), "p99": round(at(0.99), 2),
            "mean": round(statistics.fmean(v) * 1e3, 2)}


def median_run(runs: list, key: Callable[[Any], float] = lambda r: r.seconds) -> Any:
    """The middle of a contender's interleaved rounds by `key` (wall time by default): the
    round a noisy neighbour slowed neither most nor least (the upper middle of an even count)."""
    return sorted(runs, key=key)[len(runs) // 2]
