"""What long-context answers SAY, not only their status (the incident's tests never looked).

A fact ("The secret code for tenant Dunmore is 65125.") sits 30% of the way into a ~3,000
token chat prompt of filler text; the question at the end asks for it. SmolLM2-135M
retrieves it (checked: float32 and bfloat16, several depths and seeds at 2,500-3,000
tokens; a few seeds it misses, so the seed is fixed). The float32 greedy answer must
contain the code; bfloat16 and a configuration with small prefill chunks and a pool so
tight that the request is preempted and recomputed must give the same answer; and
another tenant's request running beside it must not pick up the code (nor the reverse).

The prompt builder lives in kvfence/bench/coherence.py so PD tests can reuse it.
"""
from __future__ import annotations

import pytest

from kvfence import LLM, SamplingParams
from kvfence.bench.coherence import needle_prompt
from kvfence.engine.request_states import State
from kvfence.kv.audit import ReadAudit

TARGET_TOKENS = 3000   # long_needle in tests/conftest.py
PAGE_BYTES_FP32 = 737280  # SmolLM2-135M, 16-token page, float32


@pytest.fixture
def needle(long_needle):
    return long_needle   # tests/conftest.py, shared with the PD coherence test


@pytest.fixture
def fp32_answer(long_needle_fp32_answer):
    return long_needle_fp32_answer


def test_prompt_is_long_and_the_fact_is_deep(needle):
    assert abs(len(needle.prompt_ids) - TARGET_TOKENS) <= 16
    assert 0.25 * TARGET_TOKENS < needle.fact_token_offset < 0.35 * TARGET_TOKENS
    assert needle.code in needle.messages[0]["content"] and needle.code not in needle.messages[0]["content"][-200:]


def test_float32_answer_says_the_code(fp32_answer, needle):
    assert fp32_answer.finish_reason == "stop", fp32_answer
    assert needle.answered(fp32_answer.text), fp32_answer.text


def test_bfloat16_gives_the_same_answer(needle, fp32_answer, loaded_bf16):
    llm = LLM(dtype="bfloat16", loaded=loaded_bf16, kv_cache_memory="96MiB", clamp_context=True,
              max_num_batched_tokens=4096, progress=False)
    out = llm.generate([needle.prompt_ids], needle.params())[0]
    assert needle.answered(out.text), out.text
    assert out.text.strip() == fp32_answer.text.strip()


def test_chunked_and_preempted_gives_the_same_answer_and_nothing_leaks(loaded_fp32, needle, fp32_answer):
    # 207 usable pages (3,312 tokens): the needle alone fits, not beside the other request, so
    # the needle (started last) is preempted once and recomputed; 512-token prefill chunks.
    # The other request is short-lived: while it holds pages, a preempted request restarts
    # as soon as one chunk fits and is preempted again, which costs minutes on a CPU.
    llm = LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory=208 * PAGE_BYTES_FP32, clamp_context=True,
              max_num_batched_tokens=512, progress=False)
    eng = llm.engine
    eng.runner.audit = audit = ReadAudit(eng.ledger, log_steps=0)
    other = needle_prompt(llm.tokenizer, 900, depth=0.5, seed=5, tenant_name="Orion", code="31337")
    assert other.code != needle.code
    o = eng.add_request(other.prompt_ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        tenant="orion")
    n = eng.add_request(needle.prompt_ids, needle.params(), tenant="dunmore")
    while eng.has_unfinished():
        eng.step()
    assert o.state is State.FINISHED and n.state is State.FINISHED
    assert n.num_preemptions >= 1, "the configuration must preempt the long request"
    assert eng.scheduler.num_preemptions <= 3, eng.scheduler.num_preemptions  # no thrashing: keep CI fast
    assert needle.answered(n.text), n.text
    assert n.output_ids == fp32_answer.token_ids  # same greedy tokens, chunked and recomputed
    # no cross-talk: neither answer carries the other tenant's code, and nothing read foreign pages
    assert other.code not in n.text and needle.code not in o.text
    assert audit.clean and audit.counters["slots_read"] > 0
    led = eng.ledger
    assert led.num_owned == 0 and led.num_free + led.num_shared == led.usable_pages
