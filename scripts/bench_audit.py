"""What the read audit (kvfence/kv/audit.py) costs: one fixed workload, audit off and on,
interleaved rounds on one engine, medians. Quote the ratio, not the absolute times.

    .venv/bin/python scripts/bench_audit.py --requests 16 --prompt 256 --output 64 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfence.engine.config import EngineConfig  # noqa: E402
from kvfence.engine.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from kvfence.engine.params import SamplingParams  # noqa: E402
from kvfence.kv.audit import ReadAudit  # noqa: E402


def run_once(engine: LLMEngine, prompts: list[list[int]], output: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, tenant=f"t{i % 4}")
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--log-steps", type=int, default=32, help="audit log length (0: no log)")
    args = ap.parse_args()

    cfg = EngineConfig(dtype=args.dtype, kv_cache_memory="256MiB", clamp_context=True, progress=False,
                       enable_prefix_cache=False)
    engine = LLMEngine(cfg, LoadedModel.load(cfg))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(200, vocab - 1) for _ in range(args.prompt)] for _ in range(args.requests)]
    run_once(engine, prompts[:2], 4)  # warm-up
    audit = ReadAudit(engine.ledger, log_steps=args.log_steps)
    times: dict[str, list[float]] = {"off": [], "on": []}
    audit_s: list[float] = []
    tokens = 0
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            engine.runner.audit = audit if mode == "on" else None
            before = audit.seconds
            secs, tokens = run_once(engine, prompts, args.output)
            times[mode].append(secs)
            if mode == "on":
                audit_s.append(audit.seconds - before)
    engine.runner.audit = None
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"workload: {args.requests} requests x {args.prompt} prompt + {args.output} output tokens, {args.dtype}, "
          f"{args.rounds} interleaved rounds, {engine.config.threads()} threads")
    print(f"audit off: {tokens / off:8.1f} output tok/s (median {off:.2f} s)")
    print(f"audit on:  {tokens / on:8.1f} output tok/s (median {on:.2f} s)")
    print(f"throughput ratio on/off: {off / on:.3f}  (wall-clock overhead {100 * (on / off - 1):+.1f}%)")
    print(f"time inside ReadAudit.record: median {statistics.median(audit_s):.3f} s per round "
          f"= {100 * statistics.median(audit_s) / on:.1f}% of the audited run")
    print(f"per-round seconds: off {[round(t, 2) for t in times['off']]}, on {[round(t, 2) for t in times['on']]}")
    print(f"audit: {audit.summary()}")
    assert audit.clean, audit.violations[:3]


if __name__ == "__main__":
    main()
