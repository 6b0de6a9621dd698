"""The offline bench command runs end to end on a tiny workload and reports what it ran."""
from __future__ import annotations

import json

from kvfence.cli import main


def test_bench_tiny_workload_writes_results(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--num-requests", "2", "--prompt-tokens", "16", "--output-tokens", "4", "--quick",
               "--repeat", "1", "--peers", "", "--kv-cache-memory", "64MiB", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["workload"]["num_requests"] == 2
    names = [r["name"] for r in data["results"]]
    # and the layers on the bf16 matmul --matmul auto did not pick, where this machine has both
    from kvfence.kernels import cpu_kernels
    from kvfence.model.linear import _onednn_bf16, resolve_matmul

    both = _onednn_bf16() and cpu_kernels() is not None and cpu_kernels().has_gemm
    auto = resolve_matmul("auto")
    other = "onednn" if auto == "kvfence" else "kvfence"
    assert names == ["kvfence (checks on, scrub zero)", "kvfence (checks off, scrub zero)",
                     "kvfence (no prefill cap while decoding)", "kvfence (fused kernels off)"] + (
        [f"kvfence ({other} layers, not auto's {auto})"] if both else [])
    for r in data["results"]:
        assert r["output_tokens"] == 8 and r["seconds"] > 0 and r["ttft_ms"]["p50"] > 0
    assert "ledger checks" in data["results"][0]["note"]
    one = data["one_request"]   # the single-request row: one stream's TTFT, ITL and decode rate
    assert one["workload"]["num_requests"] == 1 and [r["name"] for r in one["results"]] == ["kvfence (default)"]
    assert one["results"][0]["output_tokens"] == 4 and one["results"][0]["decode_tps"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the PNG beside the JSON


def test_bench_structured_compares_plain_and_schema_runs(tmp_path):
    out = tmp_path / "structured.json"
    rc = main(["bench", "--structured", "--num-requests", "2", "--prompt-tokens", "16", "--output-tokens", "4",
               "--repeat", "1", "--kv-cache-memory", "64MiB", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    plain, constrained = data["results"]
    assert plain["name"] == "plain" and constrained["name"] == "response_format json_schema"
    # the same tokens either way (the schema cannot close early), and the masks were applied
    assert plain["output_tokens"] == constrained["output_tokens"] == 8
    assert "logit adjustments" in constrained["note"] and "logit adjustments" not in plain["note"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
