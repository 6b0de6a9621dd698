"""I4 and I8 on a real engine: over-length requests allocate nothing; the advertised
context never exceeds the pool unless clamping is asked for, and then it is clamped."""
from __future__ import annotations

import pytest
import torch

from kvfence import CapacityError, ContextLengthExceeded, SamplingParams
from kvfence.engine.admission import check_fits, plan_context

from .conftest import run_to_end


def test_over_length_request_is_rejected_before_any_allocation(make_llm):
    llm = make_llm(max_model_len=512)
    eng = llm.engine
    before = dict(eng.ledger.counters)
    free = eng.ledger.num_free
    prompt = [100] * 500
    with pytest.raises(ContextLengthExceeded) as e:
        eng.add_request(prompt, SamplingParams(max_tokens=20))
    msg = str(e.value)
    assert "512" in msg and "520" in msg and "500 in the prompt" in msg
    assert dict(eng.ledger.counters) == before and eng.ledger.num_free == free
    assert not eng.has_unfinished()


def test_batch_with_one_over_length_prompt_serves_the_rest(make_llm):
    llm = make_llm(max_model_len=256)
    outs = llm.generate([[100] * 300, "Hello there"], SamplingParams(temperature=0, max_tokens=8))
    assert outs[0].finish_reason == "rejected" and outs[0].token_ids == [] and "256" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
    assert llm.engine.outcomes["rejected"] == 1


def test_rejected_sequence_is_terminal(make_llm):
    llm = make_llm(max_model_len=64)
    eng = llm.engine
    with pytest.raises(ContextLengthExceeded):
        eng.add_request([5] * 60, SamplingParams(max_tokens=10), request_id="r1")
    assert "r1" not in eng.requests  # nothing to schedule, nothing to hand off


def test_default_max_tokens_fills_the_context(make_llm):
    llm = make_llm(max_model_len=64)
    seq = llm.engine.add_request([5] * 60, SamplingParams(max_tokens=None, ignore_eos=True))
    assert seq.max_tokens == 4
    run_to_end(llm.engine)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 4


def test_start_up_refuses_context_larger_than_pool(loaded_fp32):
    from kvfence import LLM

    with pytest.raises(CapacityError, match="exceeds the KV pool capacity"):
        LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="16MiB", progress=False)
    llm = LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="16MiB", clamp_context=True, progress=False)
    assert llm.engine.usable_context == llm.engine.ledger.capacity_tokens < 8192
    assert llm.engine.context.clamped


def test_plan_context_rules():
    assert plan_context(8192, None, 10000, False).usable == 8192
    assert plan_context(8192, 4096, 1000, True).usable == 1000
    with pytest.raises(CapacityError):
        plan_context(8192, 4096, 1000, False)
    with pytest.raises(CapacityError, match="exceeds the model's context"):
        plan_context(8192, 9000, 100000, True)
    with pytest.raises(ValueError, match="empty"):
        check_fits(0, 1, 10)
    check_fits(5, 5, 10)
    with pytest.raises(ContextLengthExceeded):
        check_fits(5, 6, 10)


@pytest.mark.parametrize("policy,expect", [("zero", 0.0), ("poison", float("nan")), ("none", None)])
def test_scrub_policy_applies_to_freed_pages(make_llm, policy, expect):
    llm = make_llm(scrub=policy)
    eng = llm.engine
    seq = eng.add_request(llm.tokenizer.encode("Some private text of a tenant"), SamplingParams(max_tokens=3))
    eng.step()
    pages = list(seq.table.pages)
    run_to_end(eng)
    data = eng.pool.read_pages(pages)
    if expect is None:
        assert data.abs().sum() > 0  # left as it was: only the ledger protects it
    elif expect == 0.0:
        assert torch.count_nonzero(data) == 0
    else:
        assert torch.isnan(data).all()
    assert torch.count_nonzero(eng.pool.read_pages([0])) == 0  # null page stays zero


def test_request_the_pool_cannot_hold_is_aborted_with_a_capacity_code(make_llm):
    """Admission passed (it fits the context), but quarantined pages leave too little room:
    the request ends with kv_pool_exhausted instead of waiting forever."""
    llm = make_llm(max_model_len=256)
    eng = llm.engine
    led = eng.ledger
    led.quarantine(range(1, led.num_pages - 4), "test")  # 4 pages (64 tokens) left
    seq = eng.add_request([100] * 100, SamplingParams(max_tokens=4))
    run_to_end(eng)
    assert seq.finish_reason == "aborted" and seq.abort_code == "kv_pool_exhausted"
    assert "cannot hold" in seq.error and led.num_owned == 0
    other = eng.add_request([100] * 10, SamplingParams(max_tokens=4))
    eng.abort(other.request_id)
    assert other.abort_code == "client" and led.num_owned == 0


def test_a_pool_larger_than_the_machine_is_refused_before_it_is_allocated(loaded_fp32, monkeypatch):
    # 900GiB on a 24 GiB machine used to end in the allocator's "can't allocate memory" traceback
    from kvfence import LLM
    from kvfence.engine import llm_engine

    monkeypatch.setattr(llm_engine, "available_memory", lambda device: 1 << 30)
    with pytest.raises(CapacityError, match=r"2GiB is 2.0 GiB, more than the 1.0 GiB of memory this machine has"):
        LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="2GiB", progress=False)
    LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="16MiB", clamp_context=True, progress=False)


def test_a_size_that_does_not_parse_fails_before_anything_loads():
    from kvfence.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cannot read '64XB' as a size"):
        EngineConfig(kv_cache_memory="64XB")


def test_a_refused_start_is_one_line_and_a_crash_keeps_its_traceback(caplog):
    # the operator's `kvfence serve` says "not serving: <why>"; a traceback above it read as a crash
    from kvfence.server.engine_loop import EngineLoop

    def refuse():
        raise CapacityError("advertised context 8192 tokens exceeds the KV pool capacity of 2896 tokens")

    def crash():
        raise RuntimeError("a bug")

    for factory, traced in ((refuse, False), (crash, True)):
        caplog.clear()
        loop = EngineLoop(factory, None).start()
        assert not loop.wait_ready(30) and loop.error.split(":")[0] in ("CapacityError", "RuntimeError")
        assert loop.finished.wait(30)   # the error is set before it is logged
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert bool(errors) == traced and all("Traceback" in r.getMessage() for r in errors)
