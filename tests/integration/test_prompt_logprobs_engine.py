"""The engine's prompt logprobs (SamplingParams.prompt_logprobs) and max_tokens=0, on the real
float32 model: teacher-forced consistency, chunked prefill, the prefix cache, preemption."""
from __future__ import annotations

import pytest

from kvfence import SamplingParams
from kvfence.engine.request_states import State

PROMPT = ("The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is Madrid, "
          "and the capital of Portugal is")


def run(eng, ids, params, tenant="A"):
    seq = eng.add_request(ids, params, tenant=tenant)
    while eng.has_unfinished():
        eng.step()
    return seq


def scored(seq) -> list[float]:
    return [lp.logprob for lp in seq.prompt_logprobs]


def test_max_tokens_0_scores_the_prompt_as_teacher_forcing_and_samples_nothing(make_llm):
    llm = make_llm()
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    s = run(eng, ids, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))
    assert s.state is State.FINISHED and s.finish_reason == "length" and s.output_ids == []
    assert [lp.token_id for lp in s.prompt_logprobs] == ids[1:]
    for t in range(1, len(ids)):
        forced = run(eng, ids[:t], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                  logit_bias={ids[t]: 100.0}))
        assert forced.output_ids == [ids[t]]
        assert abs(forced.logprobs[0].logprob - s.prompt_logprobs[t - 1].logprob) < 1e-4
        assert forced.logprobs[0].top[0][0] == s.prompt_logprobs[t - 1].top[0][0]


def test_chunks_preemption_and_a_warm_prefix_cache_score_the_same(make_llm):
    llm = make_llm()
    ids = llm.tokenizer.encode(PROMPT)
    p = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    ref = run(llm.engine, ids, p)
    assert len(ref.prompt_logprobs) == len(ids) - 1 and all(lp.top == [] for lp in ref.prompt_logprobs)
    again = run(llm.engine, ids, p)   # its pages are cached now: it computes (and scores) them anyway
    assert again.cached_tokens == 0 and scored(again) == pytest.approx(scored(ref), abs=1e-4)
    plain = run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert plain.cached_tokens > 0 and plain.output_ids == ref.output_ids
    chunked = make_llm(max_num_batched_tokens=7).engine
    c = run(chunked, ids, p)
    assert scored(c) == pytest.approx(scored(ref), abs=1e-4) and c.output_ids == ref.output_ids
    # preempted mid-prefill: what it scored before is kept, nothing is scored twice
    eng = make_llm(max_num_batched_tokens=7).engine
    seq = eng.add_request(ids, p, tenant="A")
    eng.step()
    eng.step()
    assert 0 < len(seq.prompt_logprobs) < len(ids) - 1
    eng.scheduler._preempt(seq)
    while eng.has_unfinished():
        eng.step()
    assert seq.num_preemptions == 1 and seq.state is State.FINISHED
    assert [lp.token_id for lp in seq.prompt_logprobs] == ids[1:]
    assert scored(seq) == pytest.approx(scored(ref), abs=1e-4) and seq.output_ids == ref.output_ids



def test_the_offline_api_returns_them_as_vllm_does(make_llm):
    llm = make_llm()
    ids = llm.tokenizer.encode(PROMPT)
    out, plain = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2),
                                                 SamplingParams(temperature=0, max_tokens=2)])
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None and [lp.token_id for lp in out.prompt_logprobs[1:]] == ids[1:]
    assert all(len(lp.top) == 2 for lp in out.prompt_logprobs[1:])
    assert plain.prompt_logprobs is None and len(plain.token_ids) == 2


def test_the_default_fused_bf16_path_scores_bit_for_bit_as_teacher_forcing(loaded_bf16):
    """The default configuration's rows do not depend on the batch around them: a prompt
    token's logprob is exactly the forced next token's, in one step or in 7-token chunks."""
    from kvfence import LLM

    engines = [LLM(dtype="bfloat16", loaded=loaded_bf16, kv_cache_memory="64MiB", clamp_context=True, progress=False,
                   max_num_batched_tokens=b).engine for b in (2048, 7)]
    if "fused" not in engines[0].compute_path:
        pytest.skip(f"the CPU kernels are not built here ({engines[0].compute_path})")
    ids = engines[0].tokenizer.encode(PROMPT)
    whole, chunked = (run(e, ids, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)) for e in engines)
    assert scored(whole) == scored(chunked)
    for t in range(1, len(ids)):
        forced = run(engines[0], ids[:t], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                         logit_bias={ids[t]: 100.0}))
        assert forced.logprobs[0].logprob == whole.prompt_logprobs[t - 1].logprob, t
