"""`kvfence bench --structured`: what response_format costs per generated token.

The offline workload (32 x 256 prompt tokens -> 128 output tokens, greedy, one batch) run
plain and with every request held to a JSON schema, interleaved round after round; medians
reported. The schema (an array of at least 64 small objects) cannot close within 128 tokens,
so both variants produce the same number of tokens and the per-token times compare.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from kvfence.bench.offline import Result, Workload, _print_row, base_config, run_engine
from kvfence.bench.stats import median_run
from kvfence.engine.llm_engine import LoadedModel
from kvfence.engine.params import SamplingParams

SCHEMA = {"type": "array", "minItems": 64,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                     "n": {"type": "integer"},
                                                     "ok": {"type": "boolean"}},
                    "required": ["name", "n", "ok"], "additionalProperties": False}}


def _per_token_ms(r: Result) -> float:
    return 1e3 * r.seconds / r.output_tokens


def main(args) -> int:
    wl = Workload(args.num_requests, args.prompt_tokens, args.output_tokens)
    base = base_config(args)
    loaded = LoadedModel.load(base)
    plain = SamplingParams(temperature=0.0, max_tokens=wl.output_tokens, ignore_eos=True)
    variants = [("plain", plain), ("response_format json_schema", SamplingParams(
        temperature=0.0, max_tokens=wl.output_tokens, ignore_eos=True, json_schema=SCHEMA))]
    runs: dict[str, list[Result]] = {name: [] for name, _ in variants}
    for rnd in range(args.repeat):
        for name, params in variants:
            r = run_engine(name, loaded, base, wl, params)
            runs[name].append(r)
            print(f"[round {rnd + 1}/{args.repeat}] ", end="")
            _print_row(r)
    med = {name: median_run(rs) for name, rs in runs.items()}
    a, b = med["plain"], med["response_format json_schema"]
    print("\nmedians:")
    for r in (a, b):
        _print_row(r)
    print(f"\nworkload: {wl.num_requests} requests x {wl.prompt_tokens} prompt tokens -> {wl.output_tokens} output "
          f"tokens, greedy, one batch; {base.threads()} threads")
    print(f"  per generated token (whole run): plain {_per_token_ms(a):.2f} ms, with a schema "
          f"{_per_token_ms(b):.2f} ms: {b.seconds / a.seconds:.3f}x")
    if a.itl_ms and b.itl_ms:
        print(f"  decode step (median inter-token latency at batch {wl.num_requests}): plain {a.itl_ms['p50']:.1f} ms, "
              f"with a schema {b.itl_ms['p50']:.1f} ms: {b.itl_ms['p50'] / a.itl_ms['p50']:.3f}x")
    if args.json:
        doc = {"workload": asdict(wl), "schema": SCHEMA, "results": [asdict(a), asdict(b)]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(args.json, doc, "kvfence bench --structured: plain against a JSON schema")
    return 0
