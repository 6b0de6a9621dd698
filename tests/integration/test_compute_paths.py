"""The fused CPU kernels and the plain-torch path (CUDA's, and any machine without a C++
compiler) run the real model to the same greedy tokens, through the whole engine: mixed
batches, chunked prefill over many pages, a prefix-cache hit, a preempted request."""
from __future__ import annotations

import pytest

from kvfence import SamplingParams
from kvfence.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels not built on this machine")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def workload(llm):
    long_prompt = " ".join(f"item {i} is {i * 7 % 13}," for i in range(60))  # ~600 tokens, 4 chunks of 160
    shared = ("You are a careful assistant for a weather service. Answer in one short sentence, in plain "
              "words, without lists, and say when you are not sure. Keep units metric. ")  # > 2 pages
    return [
        llm.generate(["The capital of France is", "def fib(n):", long_prompt], GREEDY),
        llm.generate([shared + "What is rain?"], GREEDY),
        llm.generate([shared + "What is snow?"], GREEDY),  # its first pages come from the prefix cache
    ]


# fp32 page: 728 KiB; 24MiB: 32 pages, the long prompt needs all of them
@pytest.mark.parametrize("pool", ["64MiB", "24MiB"], ids=["roomy", "preempting"])
def test_fused_and_torch_paths_give_the_same_tokens(make_llm, pool):
    runs = {}
    for fused in (True, False):
        llm = make_llm(fused_kernels=fused, kv_cache_memory=pool, max_num_batched_tokens=160)
        assert llm.engine.compute_path == ("fused CPU kernels" if fused else "torch ops")
        outs = workload(llm)
        runs[fused] = [[o.token_ids for o in batch] for batch in outs]
        runs.setdefault("preemptions", []).append(llm.engine.scheduler.num_preemptions)
        runs.setdefault("cache_hits", []).append(llm.engine.prefix_cache.hits)
    assert runs[True] == runs[False]
    assert min(runs["cache_hits"]) > 0, "the second shared-prefix prompt was meant to hit the cache"
    if pool == "24MiB":
        assert min(runs["preemptions"]) > 0, "the small pool was meant to preempt"
