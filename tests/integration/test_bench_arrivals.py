"""The arrivals workload runs on a real engine: every request arrives on schedule and finishes."""
from __future__ import annotations

from dataclasses import replace

from kvfence.bench.arrivals import Arrivals, run_arrivals, setting_name, settings
from kvfence.engine.config import EngineConfig


def test_schedule_is_deterministic_and_starts_at_zero():
    wl = Arrivals(num_requests=6, prompt_lengths=(8, 16), mean_gap_s=0.1, seed=3)
    a, b = wl.schedule(1000), wl.schedule(1000)
    assert a == b and a[0][0] == 0.0
    assert [t for t, _ in a] == sorted(t for t, _ in a)
    assert {len(p) for _, p in a} <= {8, 16}
    assert a != replace(wl, seed=4).schedule(1000)


def test_each_cap_with_each_target_and_no_cap_once():
    wanted = settings([256, 0], [200.0, 0.0])
    assert wanted == [(256, 200.0), (256, 0.0), (0, 0.0)]
    assert len({setting_name(s) for s in wanted}) == 3


def test_arrivals_run_to_completion_with_and_without_the_cap(loaded_fp32):
    wl = Arrivals(num_requests=3, prompt_lengths=(40,), output_tokens=6, mean_gap_s=0.02)
    base = EngineConfig(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64,
                        clamp_context=True, progress=False)
    for cap in (0, 16):
        r = run_arrivals(f"cap {cap}", loaded_fp32, replace(base, prefill_tokens_while_decoding=cap), wl)
        assert r.output_tokens == 18 and r.total_tokens == 18 + 120
        assert r.ttft_ms["p50"] > 0 and r.itl_ms["max"] >= r.itl_ms["p99"] >= r.itl_ms["p50"] > 0
        assert "violations={}" in r.note
