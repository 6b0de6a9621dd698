"""The arrivals workload: requests that come in over time while others decode.

The fixed workload submits everything at once, so no stream is decoding while a prompt
prefills except in its first steps; here each prompt lands on streams already generating,
and every decoding stream waits for the whole step that computes it. The gaps between a
stream's tokens (ITL) are what a user sees stall. The schedule is deterministic: seeded
exponential gaps (a Poisson process) and seeded prompt lengths up to the full step budget.

    python -m kvfence.bench.arrivals --caps 0,128,256,512 --targets 200,0 --repeat 2

compares settings of the prefill cap in one run (0: the whole step budget, the old policy),
each non-zero cap with each step-time target (0: the fixed token cap; engine/step_target.py).
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass, replace

from kvfence.bench.offline import Result
from kvfence.bench.stats import median_run, percentiles
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine, LoadedModel
from kvfence.engine.params import SamplingParams


@dataclass
class Arrivals:
    num_requests: int = 12
    prompt_lengths: tuple[int, ...] = (256, 512, 1024, 2048)  # drawn per request
    output_tokens: int = 128
    mean_gap_s: float = 1.0
    seed: int = 0

    def schedule(self, vocab: int) -> list[tuple[float, list[int]]]:
        """(seconds after the start, prompt) per request, in arrival order; the first at 0."""
        rng = random.Random(self.seed)
        at, out = 0.0, []
        for i in range(self.num_requests):
            if i:
                at += rng.expovariate(1 / self.mean_gap_s)
            n = rng.choice(self.prompt_lengths)
            out.append((at, [rng.randrange(200, vocab - 1) for _ in range(n)]))
        return out

    def describe(self) -> str:
        return (f"{self.num_requests} requests arriving as a seeded Poisson process (mean gap {self.mean_gap_s} s), "
                f"prompts of {'/'.join(map(str, self.prompt_lengths))} tokens -> {self.output_tokens} output tokens")


def run_arrivals(name: str, loaded: LoadedModel, cfg: EngineConfig, wl: Arrivals) -> Result:
    """Submit each request once its arrival time has passed (between steps, as a server's loop
    does) and step until all are done. TTFT counts from the scheduled arrival, so it includes
    the wait for the step in flight; ITL is every gap between a request's consecutive tokens."""
    engine = LLMEngine(cfg, loaded)
    plan = wl.schedule(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=wl.output_tokens, ignore_eos=True)
    engine.add_request([200] * 20, replace(params, max_tokens=4))  # warm-up, unrelated to the prompts
    while engine.has_unfinished():
        engine.step()
    seqs, arrived, steps = [], [], 0
    start = time.perf_counter()
    while len(seqs) < len(plan) or engine.has_unfinished():
        now = time.perf_counter() - start
        while len(seqs) < len(plan) and plan[len(seqs)][0] <= now:
            at, prompt = plan[len(seqs)]
            seqs.append(engine.add_request(prompt, params))
            arrived.append(start + at)
        if engine.has_unfinished():
            engine.step()
            steps += 1
        else:
            time.sleep(max(0.0, plan[len(seqs)][0] - now))
    seconds = time.perf_counter() - start
    out = sum(len(s.output_ids) for s in seqs)
    if out != wl.num_requests * wl.output_tokens:
        raise RuntimeError(f"{name}: produced {out} tokens, expected {wl.num_requests * wl.output_tokens}")
    ttft = [s.first_token_at - t for s, t in zip(seqs, arrived)]
    itl = [b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    itl_ms = percentiles(itl)
    itl_ms["max"] = round(max(itl) * 1e3, 2)
    prompt_tokens = sum(len(p) for _, p in plan)
    return Result(name, seconds, out, out + prompt_tokens, percentiles(ttft), itl_ms,
                  note=f"{steps} steps; prefill cap while decoding {cfg.prefill_tokens_while_decoding or 'none'}"
                       f"{f' (last {engine.scheduler.prefill_budget_while_decoding})' if engine.step_target else ''}; "
                       f"preemptions={engine.scheduler.num_preemptions} violations={dict(engine.ledger.violations)}")


Setting = tuple[int, float]   # (prefill cap while decoding, step-time target ms); cap 0: no cap


def settings(caps: list[int], targets: list[float]) -> list[Setting]:
    """Each non-zero cap with each target, and no cap once."""
    return [(c, t) for c in caps for t in (targets if c else [0.0])]


def setting_name(s: Setting) -> str:
    cap, target = s
    if not cap:
        return "kvfence arrivals (no prefill cap: the whole step budget)"
    return f"kvfence arrivals (prefill cap {cap} while decoding, " + (
        f"sized to a {target:g} ms step)" if target else "fixed)")


def compare(loaded: LoadedModel, base: EngineConfig, wanted: list[Setting], wl: Arrivals, repeat: int,
            show=print) -> list[Result]:
    """Each setting's median over `repeat` interleaved rounds (a noisy neighbour slows all alike)."""
    runs: dict[Setting, list[Result]] = {s: [] for s in wanted}
    for rnd in range(repeat):
        for s in wanted:
            cfg = replace(base, prefill_tokens_while_decoding=s[0], decode_step_target_ms=s[1])
            r = run_arrivals(setting_name(s), loaded, cfg, wl)
            runs[s].append(r)
            show(f"[arrivals round {rnd + 1}/{repeat}] {_row(r)}")
    out = []
    for s in wanted:
        med = median_run(runs[s], key=lambda r: r.itl_ms["p99"])
        med.note += "; ITL p99 per round " + ", ".join(f"{r.itl_ms['p99']:.0f}" for r in runs[s]) + " ms"
        out.append(med)
    return out


def _row(r: Result) -> str:
    return (f"{r.name:70s} {r.seconds:6.2f} s  ITL p50 {r.itl_ms['p50']:6.1f} p99 {r.itl_ms['p99']:7.1f} "
            f"max {r.itl_ms['max']:7.1f} ms  TTFT p50 {r.ttft_ms['p50']:7.1f} p99 {r.ttft_ms['p99']:7.1f} ms  {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="0,256", help="comma-separated prefill caps to compare (0: none)")
    ap.add_argument("--targets", default="200,0",
                    help="comma-separated step-time targets in ms for each non-zero cap (0: the fixed cap)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=Arrivals.num_requests)
    ap.add_argument("--mean-gap", type=float, default=Arrivals.mean_gap_s)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    wl = Arrivals(num_requests=a.num_requests, mean_gap_s=a.mean_gap)
    base = EngineConfig(kv_cache_memory="1GiB", num_threads=a.threads, clamp_context=True, progress=False)
    wanted = settings([int(c) for c in a.caps.split(",")], [float(t) for t in a.targets.split(",")])
    results = compare(LoadedModel.load(base), base, wanted, wl, a.repeat)
    print(f"\n{wl.describe()}; medians by ITL p99:")
    for r in results:
        print(_row(r))
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"arrivals": asdict(wl), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
