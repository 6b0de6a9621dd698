"""What preemption costs: tokens the model computes against the tokens a workload needs.

A pool too small for every request at once makes the scheduler preempt; a preempted
request comes back and attaches what its own prefix cache still holds, and recomputes the
rest. This runs the real engine (scheduler, ledger, prefix cache, runner) on the
simulation's tiny random model, where a step costs about a millisecond, so the count is
the point, not the time:

    python -m kvfence.bench.preemption

needed = each request's prompt + output - 1 (the last sampled token is never computed);
computed = what the model computed, the engine's `tokens_computed`.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

import torch

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.params import SamplingParams
from kvfence.kv.pool import page_bytes
from kvfence.sim.model import VOCAB, tiny_loaded


@dataclass
class Workload:
    requests: int = 16
    prompt: int = 60
    output: int = 60
    pages: int = 100
    page_size: int = 4
    budget: int = 64
    tenants: int = 1
    shared_prefix: int = 0     # tokens every prompt starts with (a common system prompt)
    seed: int = 0


def run(w: Workload) -> dict:
    loaded = tiny_loaded()
    pb = page_bytes(loaded.model.config, w.page_size, torch.float32)
    eng = LLMEngine(EngineConfig(dtype="float32", device="cpu", page_size=w.page_size,
                                 kv_cache_memory=(w.pages + 1) * pb, max_model_len=w.prompt + w.output,
                                 max_num_seqs=w.requests, max_num_batched_tokens=w.budget, scrub="none",
                                 num_threads=1, progress=False), loaded)
    rnd = random.Random(w.seed)
    head = [rnd.randrange(2, VOCAB) for _ in range(w.shared_prefix)]
    params = SamplingParams(temperature=0.0, max_tokens=w.output, ignore_eos=True)
    for i in range(w.requests):
        prompt = head + [rnd.randrange(2, VOCAB) for _ in range(w.prompt - w.shared_prefix)]
        eng.add_request(prompt, params, tenant=f"t{i % w.tenants}")
    steps = finished = 0
    while eng.has_unfinished():
        finished += sum(1 for o in eng.step() if o.finished)
        steps += 1
    s = eng.stats()
    return {**asdict(w), "needed": w.requests * (w.prompt + w.output - 1), "computed": s["tokens_computed"],
            "preemptions": s["preemptions"], "cache_hit_tokens": s["prefix_cache_hit_tokens"], "steps": steps,
            "finished": finished}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    rows = [run(w) for w in (Workload(), Workload(tenants=2), Workload(shared_prefix=32), Workload(pages=60),
                             Workload(requests=32, pages=150))]
    print(f"{'workload':<34} {'needed':>7} {'computed':>9} {'ratio':>6} {'preempt':>8} {'hits':>6}")
    for r in rows:
        name = (f"{r['requests']}x{r['prompt']}+{r['output']} {r['pages']}p t{r['tenants']}"
                + (f" shared{r['shared_prefix']}" if r["shared_prefix"] else ""))
        print(f"{name:<34} {r['needed']:>7} {r['computed']:>9} {r['computed'] / r['needed']:>6.2f} "
              f"{r['preemptions']:>8} {r['cache_hit_tokens']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
