"""`kvfence bench --pd` runs end to end on a tiny workload: a single node, then a PD cluster
(three processes, Mooncake between them), then raw Mooncake, and reports all three."""
from __future__ import annotations

import json

import pytest

from kvfence.cli import main

pytest.importorskip("mooncake.engine", reason="bench --pd needs mooncake-transfer-engine-non-cuda")


def test_bench_pd_tiny_workload_writes_results(tmp_path):
    out = tmp_path / "bench_pd.json"
    rc = main(["bench", "--pd", "--num-requests", "2", "--prompt-tokens", "16", "--output-tokens", "4",
               "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["workload"]["num_requests"] == 2
    for mode in ("single", "pd"):
        r = data[mode]
        assert r["ok"] == 2 and r["output_tokens"] == 8 and r["ttft_ms"]["p50"] > 0, r
    assert data["ratios"]["output_tps"] > 0
    t = data["transfer"]
    kv, idle, raw = t["kvfence_under_load"], t["kvfence_one_at_a_time"], t["raw_mooncake"]
    for x in (kv, idle):  # every request's KV crossed over, in whole rows
        assert x["pulls"] >= 2 and x["bytes"] >= x["pulls"] * x["row_bytes"], x
    assert raw["row_bytes"] == kv["row_bytes"] and raw["rows_per_pull"] == round(kv["rows_per_pull"])
    assert raw["mib_per_s"] > 0 and kv["vs_raw"] is not None
    seal = data["sealing"]   # AES-GCM on rows of the same size, measured in the same run
    assert seal["row_bytes"] == kv["row_bytes"] and seal["seal_mib_per_s"] > 0 and seal["open_mib_per_s"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
