"""`kvfence bench --failover`'s account of a run (kvfence/bench/failover.py summarize): which
answers came before the kill, which were in flight at it, which after; the failures by kind."""
from __future__ import annotations

from kvfence.bench.failover import Outcome, summarize


def test_answers_are_split_at_the_kill_and_failures_counted_by_kind():
    kill = 10.0
    outcomes = [Outcome(1.0, ttft=2.0),            # its first token at 3.0: before
                Outcome(9.0, ttft=2.5),            # sent before, first token after: in flight at the kill
                Outcome(9.5, ttft=0.2),            # first token at 9.7: before, though it ended later
                Outcome(11.0, ttft=0.3),           # after
                Outcome(9.8, error="mid-stream node_failed"),
                Outcome(12.0, error="HTTP 503 node_failed"), Outcome(12.5, error="HTTP 503 node_failed")]
    r = summarize(outcomes, kill)
    assert r["requests"] == 7 and r["answered"] == 4
    assert r["errors"] == {"mid-stream node_failed": 1, "HTTP 503 node_failed": 2}
    n = {phase: t["n"] for phase, t in r["ttft_ms"].items()}
    assert n == {"before": 2, "in_flight_at_kill": 1, "after": 1}
    assert r["ttft_ms"]["in_flight_at_kill"]["p50"] == 2500.0


def test_without_a_kill_every_answer_is_before_it():
    r = summarize([Outcome(0.0, ttft=0.5), Outcome(1.0, ttft=0.7)], None)
    assert r["ttft_ms"]["before"]["n"] == 2 and r["ttft_ms"]["after"]["n"] == 0
