"""The bench's PNG: drawn from real Result/Score records as the bench writes them, read back."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from kvfence.bench.fidelity import Score
from kvfence.bench.offline import Result
from kvfence.bench.plot import render

matplotlib = pytest.importorskip("matplotlib", reason="the bench extra (scripts/setup.sh installs it)")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench_doc() -> dict:
    rows = [Result("kvfence (checks on, scrub zero)", 9.9, 4096, 12288, {"p50": 1100.0, "p99": 3900.0},
                   {"p50": 36.0, "p99": 1050.0}),
            Result("kvfence (no prefill cap while decoding)", 9.8, 4096, 12288, {"p50": 1000.0, "p99": 3800.0},
                   {"p50": 35.0, "p99": 1100.0}),
            Result("vLLM CPU", 11.8, 4096, 12288)]   # a peer without per-request latencies
    arrivals = [Result("kvfence arrivals (prefill cap 256 while decoding)", 14.0, 2048, 18000,
                       {"p50": 300.0, "p99": 2100.0}, {"p50": 40.0, "p99": 170.0, "max": 400.0})]
    return {"workload": {"num_requests": 32, "prompt_tokens": 256, "output_tokens": 128},
            "results": [asdict(r) for r in rows],
            "arrivals": {"workload": {}, "results": [asdict(r) for r in arrivals]}}


def _fidelity_doc() -> dict:
    scores = [Score("kvfence bf16, fused kernels (default)", 4100, 0.9866, 0.0169, 0.9, 0, 3.0, {"chat": 0.99}),
              Score("transformers bf16", 4100, 0.9776, 0.0223, 1.1, 12, 9.0)]
    return {"positions": 4100, "reference": "kvfence float32", "scores": [asdict(s) for s in scores]}


def _read(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image as mpimg

    return mpimg.imread(path)


def test_bench_json_renders_a_png_with_a_panel_per_view(tmp_path):
    img = _read(render([_bench_doc()], tmp_path / "bench.png", "a title"))
    h, w = img.shape[:2]
    assert 800 <= w <= 3000 and 5 * 150 <= h <= 5000   # throughput, TTFT, ITL, arrivals ITL and TTFT
    assert img[..., :3].std() > 0.05   # something drawn, not a blank canvas


def test_the_fidelity_table_adds_a_panel(tmp_path):
    alone = _read(render([_bench_doc()], tmp_path / "a.png"))
    both = _read(render([_bench_doc(), _fidelity_doc()], tmp_path / "b.png"))
    assert both.shape[0] > alone.shape[0]
    fid = _read(render([_fidelity_doc()], tmp_path / "f.png"))
    assert fid.shape[0] >= 200 and fid.shape[1] >= 800


def test_nothing_to_draw_is_an_error_not_an_empty_png(tmp_path):
    with pytest.raises(ValueError, match="nothing to draw"):
        render([{"workload": {}, "results": []}], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_each_timed_bench_json_draws_its_workloads(tmp_path):
    # the README says every timed bench's --json draws a PNG; --url, --pd and --native wrote none
    from kvfence.bench.http_load import Report
    from kvfence.bench.plot import _workloads

    lat = {"p50": 30.0, "p90": 40.0, "p99": 50.0, "mean": 33.0}
    rep = asdict(Report("http://127.0.0.1:8000", "m", "completions", 8, 2, 64, 16, 4.0, 7, {"HTTP 429": 1}, 112,
                        None, 28.0, 1.75, lat, lat, lat, lat))
    [(what, rows)] = _workloads(rep)
    assert what == "8 x 64 words -> 16, 2 at a time" and rows[0]["name"] == "m at http://127.0.0.1:8000, 1 failed"
    pd = {"workload": {"num_requests": 8, "prompt_words": 64, "output_tokens": 16, "concurrency": 8},
          "single": rep, "pd": rep}
    assert [r["name"] for r in _workloads(pd)[0][1]] == ["single node, 1 failed", "prefill + decode, 1 failed"]
    one = {"num_requests": 1, "prompt_tokens": 256, "output_tokens": 128}
    native = {"workloads": {"batch 1": one, "batch 32": {**one, "num_requests": 32}},
              "results": [{**asdict(Result(n, 2.0, 128, 384, lat, lat)), "workload": w}
                          for w in ("batch 1", "batch 32") for n in ("bf16", "native")]}
    assert [(w, [r["name"] for r in rows]) for w, rows in _workloads(native)] == [
        ("batch 1: 1 x 256 -> 128, all at once", ["bf16", "native"]),
        ("batch 32: 32 x 256 -> 128, all at once", ["bf16", "native"])]
    heights = [_read(render([d], tmp_path / f"{i}.png")).shape[0] for i, d in enumerate((rep, pd, native))]
    assert heights[2] > heights[1] > heights[0] > 0   # a panel set per workload, a row per contender
