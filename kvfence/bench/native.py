"""`kvfence bench --native`: the GGUF's own quantized weights (`--weights native`) against the
dequantized bf16 default and llama.cpp on the same file, in one run.

Two workloads, each contender on both, rounds interleaved (medians reported): one request at a
time (1 x 256 -> 128: TTFT, ITL, decode tok/s, where batch-1 decode is bound by the bytes of
weights read per token) and the fixed workload (32 x 256 -> 128). llama.cpp runs the file as it
is (its own quantized kernels), where llama-cpp-python is installed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from kvfence.bench.fidelity import native_formats
from kvfence.bench.offline import Result, Workload, base_config, decode_tps, run_engine
from kvfence.bench.stats import median_run
from kvfence.engine.llm_engine import LoadedModel

BF16, NATIVE = "kvfence bf16 (dequantized, default)", "kvfence native GGUF blocks"


def main(args) -> int:
    base = replace(base_config(args), weights="bf16")
    loaded = {BF16: LoadedModel.load(base), NATIVE: LoadedModel.load(replace(base, weights="native"))}
    fmts = native_formats(loaded[NATIVE].model)
    print(f"native: {fmts}; decoder stack in one call: {loaded[NATIVE].model.stack is not None}")
    workloads = {"one request": Workload(1, args.prompt_tokens, args.output_tokens),
                 "fixed workload": Workload(args.num_requests, args.prompt_tokens, args.output_tokens)}
    llama = None
    if "llama.cpp" in args.peers:
        try:
            import llama_cpp  # noqa: F401

            llama = f"llama.cpp ({loaded[NATIVE].path.name} as is)"
        except ImportError as e:
            print(f"llama.cpp peer skipped: {e} (scripts/setup_peers.sh installs it)")
    runs: dict[tuple[str, str], list[Result]] = {}
    for rnd in range(args.repeat):
        for wname, wl in workloads.items():
            for name, lm in loaded.items():
                r = run_engine(name, lm, base, wl)
                runs.setdefault((wname, name), []).append(r)
                _row(f"[round {rnd + 1}/{args.repeat}] {wname}", r, wl)
            if llama:
                from kvfence.bench import peers as P

                prompts = wl.prompts(loaded[BF16].model.config.vocab_size)
                # this machine's CPU reports AMX but faults in it; llama.cpp would take its AMX
                # buffers for these types (kvfence/bench/peers.py)
                amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
                r = P.llama_cpp_result(llama, P.run_llama_cpp(str(loaded[NATIVE].path), prompts, wl.output_tokens,
                                                              base.threads(), extra_bufts=not amx))
                runs.setdefault((wname, llama), []).append(r)
                _row(f"[round {rnd + 1}/{args.repeat}] {wname}", r, wl)
    medians = {key: median_run(rs) for key, rs in runs.items()}
    print("\nmedians:")
    doc: dict = {"workloads": {k: asdict(w) for k, w in workloads.items()}, "native": fmts, "results": []}
    for wname, wl in workloads.items():
        rows = {name: r for (w, name), r in medians.items() if w == wname}
        for r in rows.values():
            _row(wname, r, wl)
        ours = rows[NATIVE]
        for name, r in rows.items():
            if name != NATIVE:
                print(f"  {wname}: native vs {name}: {r.seconds / ours.seconds:.2f}x speed"
                      + (f", decode {decode_tps(ours, wl) / decode_tps(r, wl):.2f}x" if wl.num_requests == 1 else ""))
        doc["results"] += [{"workload": wname, **asdict(r), "decode_tps": decode_tps(r, wl)} for r in rows.values()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(args.json, doc, f"kvfence bench --native, {base.threads()} threads")
    return 0


def _row(label: str, r: Result, wl: Workload) -> None:
    dec = f"  decode {decode_tps(r, wl):6.1f} tok/s" if wl.num_requests == 1 else ""
    print(f"{label:32s} {r.name:44s} {r.seconds:7.2f} s  out {r.output_tps:7.1f} tok/s  TTFT {r.ttft_ms or '-'}  "
          f"ITL {r.itl_ms or '-'}{dec}", flush=True)
