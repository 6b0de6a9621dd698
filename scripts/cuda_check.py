#!/usr/bin/env python3
"""One-shot CUDA check of kvfence, for a borrowed GPU machine without internet or model files.

It builds a Hugging Face Llama folder with RANDOM weights of SmolLM2-135M's shapes (the
bundled GGUF does not travel), then runs, each phase catching its own errors:

  env         versions, device, which heavy modules `import kvfence` pulls in
  build       random-weight LlamaForCausalLM -> save_pretrained (safetensors) + tokenizer files
  parity      float32 on the device: kvfence vs transformers, greedy, token for token up to the
              reference's first near-tie (top-2 margin < 1e-3), and the max |logit| difference;
              plain prompts, a mixed-length batch, a 330-token prompt chunked over many pages,
              a tiny pool that forces preemption; plus seeded sampling and default pool sizing
  cpu_vs_dev  the same parity prompts through kvfence on the CPU vs kvfence on the device
  throughput  bfloat16, the `kvfence bench` workload (32 x 256 prompt tokens -> exactly 128
              output tokens, greedy, all at once): kvfence with ledger checks on and off, and
              transformers `generate` on the same weights; then a larger workload if time allows

Results go to <out>/cuda_check.json (everything), <out>/cuda_check.txt (the summary, also
printed at the end) and <out>/cuda_check.log (the whole console output); the files are
rewritten after every phase, so a run cut short still leaves what it had.

  on the GPU machine, from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/cuda_check.py --out $OUT --carry-dir .devcarry
  a CPU smoke run of every phase with tiny sizes (4 layers unless --layers):
    .venv/bin/python scripts/cuda_check.py --device cpu --quick --out /tmp/cuda_check
  the tokenizer files the GPU run carries, from the bundled GGUF (needs the `gguf` package):
    .venv/bin/python scripts/cuda_check.py --make-carry .devcarry
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# SmolLM2-135M (as read by kvfence from the bundled GGUF)
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
             max_position_embeddings=8192, tie_word_embeddings=True)
NEAR_TIE = 1e-3          # reference top-2 margin below which either token is a correct greedy choice
LOGIT_TOL = 1e-3         # what the CPU parity test asserts; reported against, not asserted
HEAVY = ("gguf", "fastapi", "uvicorn", "starlette", "mooncake", "transformers")
T0 = time.time()
STATE: dict = {}         # hands results from one phase to the next


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()

    def isatty(self):
        return False


class Report:
    def __init__(self, out: Path, args):
        self.out = out
        self.data: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
        self.lines: list[str] = []

    def line(self, s: str = "") -> None:
        self.lines.append(s)
        print(s, flush=True)

    def phase(self, name: str, fn, *a, **kw):
        log(f"=== phase {name}: start")
        t = time.time()
        entry: dict = {"status": "running"}
        self.data["phases"][name] = entry
        result = None
        try:
            result = fn(*a, **kw)
            entry["status"] = "ok"
            entry["result"] = result
        except Exception as e:  # noqa: BLE001 - one phase's failure must not lose the others
            tb = traceback.format_exc()
            print(tb, flush=True)
            entry.update(status="error", error=repr(e), traceback=tb)
            self.line(f"!! phase {name} FAILED: {e!r}")
        entry["seconds"] = round(time.time() - t, 2)
        log(f"=== phase {name}: {entry['status']} in {entry['seconds']} s")
        self.save()
        return result

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - T0, 1)
        (self.out / "cuda_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        status = ", ".join(f"{k}={v['status']}({v.get('seconds', '-')}s)" for k, v in self.data["phases"].items())
        (self.out / "cuda_check.txt").write_text("\n".join(self.lines + ["", f"phases: {status}",
                                                                         f"elapsed {self.data['elapsed_s']} s", ""]))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def guarded(rep: Report, label: str, fn, *a, **kw):
    """Run one part of a phase; on failure print the traceback, note it, return the error."""
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - a check that fails is reported, the others still run
        tb = traceback.format_exc()
        print(tb, flush=True)
        rep.line(f"  !! {label} FAILED: {e!r}")
        return {"ok": False, "error": repr(e), "traceback": tb}


def _strict_fp32(device: str) -> dict:
    """No TF32 in float32 matmuls on the GPU, so float32 parity means float32."""
    if device.startswith("cuda"):
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        except Exception as e:  # noqa: BLE001 - a check that fails is reported, the others still run
            print(f"could not turn TF32 off: {e!r}", flush=True)
    try:
        return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                "float32_matmul_precision": torch.get_float32_matmul_precision()}
    except Exception as e:  # noqa: BLE001 - a check that fails is reported, the others still run
        return {"tf32_state": repr(e)}


def _ensure_tqdm() -> str:
    """kvfence.model.weights imports tqdm (a transformers dependency, so normally present)."""
    try:
        import tqdm  # noqa: F401
        return "present"
    except ImportError:
        class _Bar:
            def __init__(self, *a, **k): pass
            def update(self, n=1): pass
            def close(self): pass
        sys.modules["tqdm"] = types.SimpleNamespace(tqdm=_Bar)
        return "missing: stubbed"


# ---------------------------------------------------------------------------- env
def phase_env(args, rep: Report) -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cpu_threads": len(os.sched_getaffinity(0)), "tqdm": _ensure_tqdm()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    before = set(sys.modules)
    import kvfence  # noqa: F401
    import kvfence.bench.offline  # noqa: F401
    import kvfence.engine.llm  # noqa: F401
    import kvfence.model.hf_loader  # noqa: F401
    info["heavy_modules_imported_by_kvfence"] = sorted(
        {m.split(".")[0] for m in set(sys.modules) - before if m.split(".")[0] in HEAVY})
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001 - a check that fails is reported, the others still run
        info["transformers"] = f"import failed: {e!r}"
    rep.line(f"torch {info['torch']} (cuda {info['torch_cuda']}), transformers {info['transformers']}, "
             f"python {info['python']}, {info['cpu_threads']} CPU threads, device {args.device}"
             + (f": {info.get('gpu')} {info.get('gpu_mem_gib')} GiB sm{info.get('capability')}"
                if info["cuda_available"] else ""))
    rep.line(f"import kvfence (+bench.offline, engine.llm, model.hf_loader) pulled in: "
             f"{info['heavy_modules_imported_by_kvfence'] or 'none of ' + '/'.join(HEAVY)}; tqdm {info['tqdm']}")
    return info


# ---------------------------------------------------------------------------- build
def make_carry(dest: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) from the bundled GGUF."""
    from kvfence.model.gguf_loader import read_metadata
    from kvfence.model.loader import default_model_path
    from kvfence.model.tokenizer import tokenizer_from_gguf_metadata

    meta = read_metadata(default_model_path())
    tok = tokenizer_from_gguf_metadata(meta)
    dest.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    print(f"wrote {dest}: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.2f} MiB" for p in sorted(dest.iterdir())))


def _synthetic_tokenizer(folder: Path, vocab: int) -> None:
    """Fallback when the carried tokenizer is missing: one word per id, enough for id prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def _hf_theta(cfg) -> float | None:
    """RoPE base as transformers sees it: 5.x keeps it in rope_parameters, 4.x in rope_theta."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(cfg, "rope_theta", None)
    return None if theta is None else float(theta)


def _load_hf(folder: Path, dtype: torch.dtype, device: str):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    theta = _hf_theta(hf.config)
    if theta != SHAPE["rope_theta"]:
        raise RuntimeError(f"transformers reads rope theta {theta} from the folder, expected {SHAPE['rope_theta']}")
    hf.generation_config.eos_token_id = None   # exactly max_new_tokens, no EOS masking (kvfence: ignore_eos)
    hf.generation_config.pad_token_id = 0
    return hf


def phase_build(args, rep: Report, folder: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvfence.model.hf_loader import config_from_hf

    shape = dict(SHAPE, num_hidden_layers=args.layers)
    hf_cfg = LlamaConfig(**shape, initializer_range=args.init_range, hidden_act="silu", bos_token_id=1,
                         eos_token_id=2)
    if _hf_theta(hf_cfg) != shape["rope_theta"]:  # a transformers that ignores the rope_theta argument
        hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(hf_cfg).eval()   # float32, on the CPU
    n_params = sum(p.numel() for p in model.parameters())
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
    except TypeError:  # transformers 5 always writes safetensors and dropped the argument
        model.save_pretrained(str(folder))
    del model
    carry = Path(args.carry_dir) if args.carry_dir else None
    if carry and (carry / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (carry / name).exists():
                shutil.copy(carry / name, folder / name)
        tokenizer = f"SmolLM2 tokenizer from {carry}"
    else:
        _synthetic_tokenizer(folder, shape["vocab_size"])
        tokenizer = f"synthetic word-level tokenizer ({carry} has no tokenizer.json)"
    raw = json.loads((folder / "config.json").read_text())
    ours = config_from_hf(raw, folder.name)
    expect = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  intermediate_size=shape["intermediate_size"], num_layers=args.layers,
                  num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"], head_dim=64,
                  rope_theta=shape["rope_theta"], rms_norm_eps=shape["rms_norm_eps"],
                  max_context=shape["max_position_embeddings"], tie_embeddings=True)
    got = asdict(ours)
    wrong = {k: (got[k], v) for k, v in expect.items() if got[k] != v}
    files = {p.name: round(p.stat().st_size / 2**20, 2) for p in sorted(folder.iterdir())}
    rep.line(f"model: random LlamaForCausalLM, {n_params / 1e6:.1f}M params, {args.layers} layers, "
             f"init std {args.init_range}, seed {args.seed}; {tokenizer}; files (MiB) {files}")
    if wrong:
        raise RuntimeError(f"kvfence reads config.json differently from the intended shape: {wrong} "
                           f"(config.json rope keys: rope_theta={raw.get('rope_theta')}, "
                           f"rope_parameters={raw.get('rope_parameters')}, rope_scaling={raw.get('rope_scaling')})")
    return {"folder": str(folder), "params": n_params, "hf_rope_theta": _hf_theta(hf_cfg), "tokenizer": tokenizer,
            "files_mib": files,
            "kvfence_config": got, "config_json_rope": {k: raw.get(k) for k in
                                                        ("rope_theta", "rope_parameters", "rope_scaling")}}


# ---------------------------------------------------------------------------- parity helpers
def _rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(200, vocab - 1) for _ in range(n)]


def parity_cases(quick: bool, vocab: int, layers: int) -> list[dict]:
    from kvfence.kv.pool import page_bytes
    from kvfence.model.config import ModelConfig

    rng = random.Random(1234)
    if quick:
        plain, plain_steps = [5, 12], 8
        base_len, n_mixed, mixed_rep, mixed_steps = 24, 3, 3, 6
        long_steps = 4
        pre_n, pre_len, pre_steps = 3, 16, 40
    else:
        plain, plain_steps = [5, 9, 17, 33], 24
        base_len, n_mixed, mixed_rep, mixed_steps = 40, 5, 6, 16
        long_steps = 12
        pre_n, pre_len, pre_steps = 4, 16, 90
    cases = [{"name": "plain", "prompts": [_rand(rng, n, vocab) for n in plain], "steps": plain_steps, "engine": {}}]
    base = _rand(rng, base_len, vocab)
    mixed = [base[: rng.randint(3, base_len)] for _ in range(n_mixed)] + [base * mixed_rep]
    cases.append({"name": "mixed_batch", "prompts": mixed, "steps": mixed_steps, "engine": {}})
    long = _rand(rng, 330, vocab)
    cases.append({"name": "long_chunked", "prompts": [long, long[:250]], "steps": long_steps,
                  "engine": {"max_num_batched_tokens": 64}})
    # a pool a little smaller than the requests' final size: preemption must happen
    cfg = ModelConfig("x", vocab, 576, 1536, layers, 9, 3, 64, 1e5, 1e-5, 8192, True)
    each = -(-(pre_len + pre_steps) // 16)
    usable = pre_n * each - 2
    cases.append({"name": "preempt", "prompts": [_rand(rng, pre_len, vocab) for _ in range(pre_n)],
                  "steps": pre_steps, "engine": {"kv_cache_memory": (usable + 1) * page_bytes(cfg, 16, torch.float32),
                                                 "max_num_batched_tokens": 512},
                  "expect_usable_pages": usable})
    return cases


def run_kvfence_case(loaded, device: str, case: dict) -> dict:
    """Greedy through kvfence, keeping the logits each token was chosen from."""
    from kvfence import LLM, SamplingParams

    kw = dict(kv_cache_memory="256MiB", clamp_context=True, progress=False)
    kw.update(case["engine"])
    llm = LLM(dtype="float32", loaded=loaded, device=device, **kw)
    engine = llm.engine
    by_request: dict[int, list[torch.Tensor]] = {}
    last: dict = {}
    run, sampler = engine.runner.run, engine.sampler

    def run_and_remember(step):
        result = run(step)
        last["sampled"] = result.sampled
        return result

    def record(logits, params, generators):
        for row, s in enumerate(last["sampled"]):
            by_request.setdefault(s.seq.owner.request, []).append(logits[row].detach().float().cpu())
        return sampler(logits, params, generators)

    engine.runner.run = run_and_remember
    engine.sampler = record
    t = time.perf_counter()
    outs = llm.generate(case["prompts"], SamplingParams(temperature=0.0, max_tokens=case["steps"], ignore_eos=True))
    seconds = time.perf_counter() - t
    order = sorted(by_request)  # request numbers grow in submission order
    info = {"finish": sorted({o.finish_reason for o in outs}), "errors": [o.error for o in outs if o.error],
            "preemptions": engine.scheduler.num_preemptions, "usable_pages": engine.ledger.usable_pages,
            "violations": dict(engine.ledger.violations), "seconds": round(seconds, 3),
            "pages_for_longest": engine.ledger.pages_for(max(len(p) for p in case["prompts"]) + case["steps"]),
            "pool_clean_after": engine.ledger.num_available == engine.ledger.usable_pages
            and engine.ledger.num_owned == 0}
    result = {"tokens": [o.token_ids for o in outs], "logits": [by_request[r] for r in order], "info": info}
    del llm, engine
    return result


def hf_reference(hf, prompt: list[int], steps: int, device: str) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [lg[0].float().cpu() for lg in out.logits]


def margin(l: torch.Tensor) -> float:
    top2 = torch.topk(l, 2).values
    return (top2[0] - top2[1]).item()


def compare(ref_tokens, ref_logits, tokens, logits) -> dict:
    """Agreement up to the reference's first near-tie; logit differences while the contexts agree."""
    margins = [margin(lg) for lg in ref_logits]
    k = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
    n = min(len(tokens), len(ref_tokens))
    mismatch = next((i for i in range(n) if tokens[i] != ref_tokens[i]), None)
    same_ctx = min(len(logits), len(ref_logits), n if mismatch is None else mismatch + 1)
    diffs = [(logits[i] - ref_logits[i]).abs().max().item() for i in range(same_ctx)]
    return {"steps": n, "len_ours": len(tokens), "len_ref": len(ref_tokens), "until_tie": k,
            "agree_until_tie": tokens[:k] == ref_tokens[:k], "first_mismatch": mismatch,
            "full_match": mismatch is None and len(tokens) == len(ref_tokens),
            "max_logit_diff": max(diffs) if diffs else None, "step0_logit_diff": diffs[0] if diffs else None,
            "max_logit_diff_first4": max(diffs[:4]) if diffs else None,
            "min_ref_margin": min(margins) if margins else None,
            "median_ref_margin": statistics.median(margins) if margins else None,
            "ref_near_ties": sum(m < NEAR_TIE for m in margins)}


def _verdict(cmps: list[dict], tol: float) -> tuple[bool, str]:
    ok = all(c["agree_until_tie"] and c["len_ours"] == c["len_ref"] for c in cmps)
    mx = max((c["max_logit_diff"] or 0.0) for c in cmps)
    within = mx < tol
    worst_margin = min((c["min_ref_margin"] for c in cmps if c["min_ref_margin"] is not None), default=float("nan"))
    full = sum(c["full_match"] for c in cmps)
    txt = (f"{'PASS' if ok and within else 'FAIL'}  tokens {'agree' if ok else 'DIFFER'} up to first near-tie "
           f"({full}/{len(cmps)} match in full, until-tie steps {[c['until_tie'] for c in cmps]}), "
           f"max |dlogit| {mx:.2e} (tol {tol:g}{'' if within else ' EXCEEDED'}), "
           f"step-0 max {max((c['step0_logit_diff'] or 0) for c in cmps):.2e}, min ref margin {worst_margin:.2e}")
    if not ok:
        txt += f"; first mismatches {[c['first_mismatch'] for c in cmps]}"
    return ok and within, txt


def _strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "logits"}


# ---------------------------------------------------------------------------- parity
def phase_parity(args, rep: Report, folder: Path) -> dict:
    from kvfence import LLM, SamplingParams
    from kvfence.engine.llm_engine import LoadedModel

    dev = args.device
    out: dict = _strict_fp32(dev)
    # the public entry point, straight from the folder; its weights then serve every case
    llm = LLM(model=str(folder), dtype="float32", device=dev, kv_cache_memory="256MiB", clamp_context=True,
              progress=False)
    loaded = LoadedModel(llm.engine.model, llm.engine.tokenizer, llm.engine.model_path)
    first = llm.generate([[300, 400, 500, 600]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    out["entry_point"] = {"tokens": first.token_ids, "finish": first.finish_reason,
                          "pool_device": str(llm.engine.pool.kv.device),
                          "weights_device": str(loaded.model.embed.device)}
    rep.line(f"LLM(model=folder, dtype=float32, device={dev}): pool on {out['entry_point']['pool_device']}, "
             f"weights on {out['entry_point']['weights_device']}, 4 greedy tokens {first.token_ids}; "
             f"TF32 matmul {out.get('tf32_matmul')}, fp32 matmul precision {out.get('float32_matmul_precision')}")
    del llm

    hf = _load_hf(folder, torch.float32, dev)
    out["hf_attn_impl"] = getattr(hf.config, "_attn_implementation", None)
    cases = parity_cases(args.quick, loaded.model.config.vocab_size, args.layers)
    STATE["parity_cases"] = cases
    STATE["dev_runs"] = {}
    out["cases"] = {}
    for case in cases:
        out["cases"][case["name"]] = guarded(rep, f"parity[{case['name']}]", _parity_case, rep, loaded, hf, dev, case)
    del hf
    free_memory(dev)
    out["sampling"] = guarded(rep, "sampling", _sampling_check, rep, loaded, dev)
    out["default_sizing"] = guarded(rep, "default pool sizing", _sizing_check, rep, loaded, dev)
    parts = list(out["cases"].values()) + [out["sampling"], out["default_sizing"]]
    out["ok"] = all(p.get("ok") for p in parts)
    rep.line(f"parity overall: {'PASS' if out['ok'] else 'FAIL'}")
    free_memory(dev)
    return out


def _parity_case(rep: Report, loaded, hf, dev: str, case: dict) -> dict:
    t = time.time()
    ours = run_kvfence_case(loaded, dev, case)
    STATE["dev_runs"][case["name"]] = ours
    refs = [hf_reference(hf, p, case["steps"], dev) for p in case["prompts"]]
    cmps = [compare(rt, rl, tk, lg) for (rt, rl), tk, lg in zip(refs, ours["tokens"], ours["logits"])]
    # transformers' own tokens are the argmax of its raw logits (sanity check of the reference)
    hf_self = all(rt == [int(lg.argmax()) for lg in rl] for rt, rl in refs)
    ok, txt = _verdict(cmps, LOGIT_TOL)
    info = ours["info"]
    extra = ""
    if case["name"] == "preempt":
        ok = ok and info["preemptions"] > 0 and info["pool_clean_after"]
        extra = (f" preemptions={info['preemptions']} usable_pages={info['usable_pages']} "
                 f"(expected {case['expect_usable_pages']}) pool clean after={info['pool_clean_after']}")
    if case["name"] == "long_chunked":
        extra = f" prompt lengths {[len(p) for p in case['prompts']]}, {info['pages_for_longest']} pages/longest"
    if info["violations"] or info["errors"] or info["finish"] != ["length"]:
        ok = False
        extra += f" violations={info['violations']} finish={info['finish']} errors={info['errors']}"
    rep.line(f"  parity[{case['name']}] {len(case['prompts'])} prompts x {case['steps']} steps: {txt};"
             f" hf-self-consistent={hf_self};{extra} ({time.time() - t:.1f} s)")
    return {"ok": ok, "comparisons": cmps, "kvfence": info, "hf_self_consistent": hf_self,
            "prompt_lengths": [len(p) for p in case["prompts"]], "steps": case["steps"]}


def _sampling_check(rep: Report, loaded, dev: str) -> dict:
    """Seeded sampling with top-k/top-p and logprobs: the per-request generator lives on the device."""
    from kvfence import LLM, SamplingParams
    from kvfence.engine.sampler import make_generator

    def fresh():  # a fresh engine each time: no prefix-cache hits, the same computation
        return LLM(dtype="float32", loaded=loaded, device=dev, kv_cache_memory="256MiB", clamp_context=True,
                   progress=False)

    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)
    sp2 = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    ps = [[300 + i for i in range(10)], [900 + i for i in range(7)]]
    a = fresh().generate(ps + [ps[0]], [sp, sp, sp2])
    b = fresh().generate(ps, [sp, sp])
    lps = [lp.logprob for o in a[:2] for lp in o.logprobs]
    samp = {"seeded_repeatable": [o.token_ids for o in a[:2]] == [o.token_ids for o in b],
            "lengths": [len(o.token_ids) for o in a], "logprobs_finite": all(math.isfinite(x) and x <= 0 for x in lps),
            "top_logprobs_per_token": len(a[0].logprobs[0].top) if a[0].logprobs else 0,
            "generator_device": str(make_generator(7, dev).device)}
    samp["ok"] = samp["seeded_repeatable"] and samp["logprobs_finite"] and samp["lengths"] == [12, 12, 12]
    rep.line(f"  sampling (seed, top-k/top-p, logprobs on {dev}): {'PASS' if samp['ok'] else 'FAIL'} {samp}")
    return samp


def _sizing_check(rep: Report, loaded, dev: str) -> dict:
    """A pool sized from free memory (torch.cuda.mem_get_info on CUDA)."""
    from kvfence import LLM, SamplingParams
    from kvfence.kv.pool import available_memory

    avail = available_memory(dev)
    llm = LLM(dtype="float32", loaded=loaded, device=dev, kv_memory_fraction=0.02, max_num_seqs=2,
              clamp_context=True, progress=False)
    o = llm.generate([[300, 301, 302]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    sizing = {"available_mib": round(avail / 2**20), "pool_mib": round(llm.engine.pool.nbytes / 2**20, 1),
              "pages": llm.engine.ledger.usable_pages, "tokens": o.token_ids,
              "ok": llm.engine.pool.nbytes > 0 and len(o.token_ids) == 4}
    rep.line(f"  default pool sizing (2% of {sizing['available_mib']} MiB free, capped by 2 full contexts): "
             f"{sizing['pool_mib']} MiB, {sizing['pages']} pages -> {'PASS' if sizing['ok'] else 'FAIL'}")
    return sizing


# ---------------------------------------------------------------------------- cpu vs device
def phase_cpu_vs_dev(args, rep: Report, folder: Path) -> dict:
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LoadedModel

    if not STATE.get("dev_runs"):
        raise RuntimeError("no device runs to compare with (the parity phase failed early)")
    threads = len(os.sched_getaffinity(0))
    loaded = LoadedModel.load(EngineConfig(model=str(folder), dtype="float32", device="cpu", progress=False))
    out: dict = {"threads": threads, "cases": {}}
    for case in STATE["parity_cases"]:
        if case["name"] in STATE["dev_runs"]:
            out["cases"][case["name"]] = guarded(rep, f"cpu-vs-{args.device}[{case['name']}]", _cross_case, rep,
                                                 loaded, case, STATE["dev_runs"][case["name"]], args.device)
    all_ok = bool(out["cases"]) and all(c.get("ok") for c in out["cases"].values())
    out["ok"] = all_ok
    rep.line(f"kvfence CPU fp32 vs {args.device} fp32 overall: {'PASS' if all_ok else 'FAIL'}")
    del loaded
    gc.collect()
    return out


def _cross_case(rep: Report, loaded, case: dict, dev_run: dict, dev: str) -> dict:
    t = time.time()
    cpu = run_kvfence_case(loaded, "cpu", case)
    # near-ties judged on the device run's own logits
    cmps = [compare(dt, dl, ct, cl) for dt, dl, ct, cl in
            zip(dev_run["tokens"], dev_run["logits"], cpu["tokens"], cpu["logits"])]
    ok, txt = _verdict(cmps, LOGIT_TOL)
    rep.line(f"  cpu-vs-{dev}[{case['name']}]: {txt} ({time.time() - t:.1f} s)")
    return {"ok": ok, "comparisons": cmps, "cpu": cpu["info"]}


# ---------------------------------------------------------------------------- throughput
def run_hf_generate(hf, wl, device: str):
    from kvfence.bench.offline import Result

    ids = torch.tensor(wl.prompts(hf.config.vocab_size), device=device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2, :32], attention_mask=mask[:2, :32], max_new_tokens=4, **kw)  # warm-up
        sync(device)
        t = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=1, **kw)  # the whole batch's prefill
        sync(device)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=wl.output_tokens, **kw)
        sync(device)
        seconds = time.perf_counter() - t
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    if n != wl.num_requests * wl.output_tokens:
        raise RuntimeError(f"transformers produced {n} tokens, expected {wl.num_requests * wl.output_tokens}")
    itl = (seconds - prefill) / max(1, wl.output_tokens - 1)
    return Result("transformers generate (bf16)", seconds, n, n + ids.numel(),
                  ttft_ms={"batch_prefill": round(prefill * 1e3, 2)}, itl_ms={"mean_est": round(itl * 1e3, 2)},
                  note="static batch; TTFT = a 1-token generate of the whole batch, ITL = (total - that) / (steps - 1)")


def _res(r) -> dict:
    d = asdict(r)
    d.update(output_tps=round(r.output_tps, 1), total_tps=round(r.total_tps, 1), seconds=round(r.seconds, 3))
    return d


def phase_throughput(args, rep: Report, folder: Path) -> dict:
    from kvfence.bench.offline import Workload
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LoadedModel

    dev = args.device
    if args.quick:
        workloads = [("standard", Workload(4, 32, 8), "64MiB", 1), ("large", Workload(8, 64, 8), "64MiB", 1)]
    else:
        workloads = [("standard", Workload(32, 256, 128), "1GiB", args.rounds),
                     ("large", Workload(256, 1024, 128), "12GiB", args.large_rounds)]
        if args.only_large:
            workloads = workloads[1:]
    loaded = LoadedModel.load(EngineConfig(model=str(folder), dtype="bfloat16", device=dev, progress=False))
    peer_model: dict = {}   # transformers bf16, loaded on first use and kept for the next workload
    out: dict = {}
    for label, wl, mem, rounds in workloads:
        if label == "large" and (args.no_large or time.time() - T0 > args.budget_s - args.large_reserve_s):
            rep.line(f"  throughput[{label}] skipped ({time.time() - T0:.0f} s elapsed, budget {args.budget_s} s)")
            out[label] = {"skipped": True}
            continue
        out[label] = guarded(rep, f"throughput[{label}]", _workload, rep, label, wl, mem, rounds, loaded,
                             peer_model, str(folder), dev)
        rep.data["phases"]["throughput"]["partial"] = out
        rep.save()
    if dev.startswith("cuda"):
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    rep.data["phases"]["throughput"].pop("partial", None)
    peer_model.clear()
    del loaded
    free_memory(dev)
    return out


def _workload(rep: Report, label: str, wl, mem: str, rounds: int, loaded, peer_model: dict, folder: str,
              dev: str) -> dict:
    from kvfence.bench.offline import _print_row, run_engine
    from kvfence.engine.config import EngineConfig

    t = time.time()
    base = EngineConfig(model=folder, dtype="bfloat16", device=dev, kv_cache_memory=mem,
                        max_num_batched_tokens=2048, clamp_context=True, progress=False)
    variants = [("kvfence (checks on)", dict(verify_reads=True)), ("kvfence (checks off)", dict(verify_reads=False))]
    runs: dict[str, list] = {n: [] for n, _ in variants}
    entry: dict = {"workload": asdict(wl), "kv_cache_memory": mem, "max_num_batched_tokens": 2048, "rounds": rounds}
    # interleaved rounds, median per variant (as `kvfence bench` does)
    for rnd in range(rounds):
        # alternate which variant goes first, so a warm-up cost does not land on one of them
        for name, over in (variants if rnd % 2 == 0 else variants[::-1]):
            r = run_engine(name, loaded, EngineConfig(**{**asdict(base), **over}), wl)
            runs[name].append(r)
            print(f"[{label} round {rnd + 1}/{rounds}] ", end="")
            _print_row(r)
            free_memory(dev)
    meds = [sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for rs in runs.values()]
    entry["kvfence"] = [_res(r) for r in meds]
    entry["kvfence_all_rounds_s"] = {n: [round(r.seconds, 3) for r in rs] for n, rs in runs.items()}
    if dev.startswith("cuda"):
        entry["peak_gpu_mib_so_far"] = round(torch.cuda.max_memory_allocated() / 2**20)
    peer = None
    try:
        if "hf" not in peer_model:
            peer_model["hf"] = _load_hf(Path(folder), torch.bfloat16, dev)
        peer = run_hf_generate(peer_model["hf"], wl, dev)
        _print_row(peer)
        entry["transformers"] = _res(peer)
    except Exception as e:  # noqa: BLE001 - a check that fails is reported, the others still run
        tb = traceback.format_exc()
        print(tb, flush=True)
        entry["transformers_error"] = tb
        rep.line(f"  throughput[{label}] transformers FAILED: {e!r}")
    on, off = meds
    rep.line(f"  throughput[{label}] {wl.num_requests} x {wl.prompt_tokens} -> {wl.output_tokens}, bf16, "
             f"kv {mem}, {rounds} round(s), medians:")
    for r in meds + ([peer] if peer else []):
        rep.line(f"    {r.name:30s} {r.seconds:7.3f} s  out {r.output_tps:9.1f} tok/s  total {r.total_tps:9.1f} tok/s"
                 f"  TTFT {r.ttft_ms}  ITL {r.itl_ms}  {r.note}")
    ratios = {"checks_off_over_on_speed": round(on.seconds / off.seconds, 3)}
    if peer:
        ratios["kvfence_on_vs_transformers_speed"] = round(peer.seconds / on.seconds, 3)
        ratios["kvfence_off_vs_transformers_speed"] = round(peer.seconds / off.seconds, 3)
    entry["ratios"] = ratios
    rep.line(f"    ratios (>1: first is faster): checks-off/on {ratios['checks_off_over_on_speed']}x"
             + (f"; kvfence(on) vs transformers {ratios['kvfence_on_vs_transformers_speed']}x, "
                f"kvfence(off) vs transformers {ratios['kvfence_off_vs_transformers_speed']}x" if peer else "")
             + f" ({time.time() - t:.1f} s)")
    entry["ok"] = True
    return entry


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cuda_check_out", help="folder for cuda_check.{json,txt,log}")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run); 4 layers unless --layers")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 30, the real model's)")
    ap.add_argument("--carry-dir", default=".devcarry", help="folder with tokenizer.json + tokenizer_config.json")
    ap.add_argument("--init-range", type=float, default=0.1, help="std of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the standard throughput workload (median)")
    ap.add_argument("--no-large", action="store_true", help="skip the 256 x 1024 -> 128 workload")
    ap.add_argument("--only-large", action="store_true", help="only the 256 x 1024 -> 128 workload")
    ap.add_argument("--large-rounds", type=int, default=1, help="interleaved rounds of the large workload")
    ap.add_argument("--budget-s", type=float, default=240.0, help="soft limit for the whole run")
    ap.add_argument("--large-reserve-s", type=float, default=90.0, help="time the large workload needs")
    ap.add_argument("--phases", default="env,build,parity,cpu_vs_dev,throughput")
    ap.add_argument("--keep-model", action="store_true", help="do not delete the temporary model folder")
    ap.add_argument("--make-carry", metavar="DIR", help="only write the tokenizer files to DIR (needs gguf), then exit")
    args = ap.parse_args()
    if args.make_carry:
        make_carry(Path(args.make_carry))
        return 0
    if args.layers is None:
        args.layers = 4 if args.quick else SHAPE["num_hidden_layers"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "cuda_check.log", "w")
    sys.stdout = Tee(sys.__stdout__, logf)
    sys.stderr = Tee(sys.__stderr__, logf)
    rep = Report(out, args)
    log(f"cuda_check: device {args.device}, quick={args.quick}, layers {args.layers}, out {out}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        rep.line(f"!! --device {args.device} but torch {torch.__version__} sees no CUDA device; "
                 f"only the env phase runs (use --device cpu --quick for a CPU run)")
        rep.phase("env", phase_env, args, rep)
        rep.save()
        return 2
    phases = args.phases.split(",")
    folder = Path(tempfile.mkdtemp(prefix="kvfence-rand-smollm2-"))
    try:
        if "env" in phases:
            rep.phase("env", phase_env, args, rep)
        _ensure_tqdm()
        built = rep.phase("build", phase_build, args, rep, folder)
        if built is None:
            rep.line("!! no model folder: the remaining phases cannot run")
        else:
            for name, fn in (("parity", phase_parity), ("cpu_vs_dev", phase_cpu_vs_dev),
                             ("throughput", phase_throughput)):
                if name in phases:
                    rep.phase(name, fn, args, rep, folder)
    finally:
        if not args.keep_model:
            shutil.rmtree(folder, ignore_errors=True)
    rep.save()
    print("\n======== summary ========")
    print((out / "cuda_check.txt").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
