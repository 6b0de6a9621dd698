"""Greedy float32 output equals Hugging Face transformers token for token.

Comparison stops at the first step where the reference's top-2 logit margin is below
1e-3: there either token is a correct greedy choice and the two may part ways.
"""
from __future__ import annotations

import random

import torch

from kvfence import SamplingParams

NEAR_TIE = 1e-3
LOGIT_TOL = 1e-3


def reference_logits(hf, prompt_ids: list[int], generated: list[int]) -> list[torch.Tensor]:
    """The reference's logits at each generated step, teacher-forced on `generated` in one
    forward pass. Up to the first step where `generated` leaves the reference's greedy path
    these are the logits its own greedy generation would have had (one pass instead of a
    generate() step per token: the same numbers within ~1e-5, for a fraction of the time)."""
    with torch.inference_mode():
        out = hf(torch.tensor([prompt_ids + generated[:-1]]))
    return list(out.logits[0, len(prompt_ids) - 1:].float())


def comparable_prefix(ref_logits: list[torch.Tensor]) -> int:
    """Number of steps before the first near-tie in the reference."""
    for i, l in enumerate(ref_logits):
        top2 = torch.topk(l, 2).values
        if (top2[0] - top2[1]).item() < NEAR_TIE:
            return i
    return len(ref_logits)


class LogitRecorder:
    """Wraps the engine's sampler to keep the logits each request was sampled from."""

    def __init__(self, engine):
        self.inner = engine.sampler
        self.by_request: dict[int, list[torch.Tensor]] = {}
        self._engine = engine
        engine.sampler = self

    def __call__(self, logits, params, generators, histories=None):
        seqs = [s.seq for s in self._engine.runner_last_sampled]
        for row, seq in enumerate(seqs):
            self.by_request.setdefault(seq.owner.request, []).append(logits[row].clone())
        return self.inner(logits, params, generators, histories)


def record_logits(llm):
    """Patch the runner so the recorder knows which row belongs to which request."""
    engine = llm.engine
    run = engine.runner.run

    def run_and_remember(step):
        result = run(step)
        engine.runner_last_sampled = result.sampled
        return result

    engine.runner.run = run_and_remember
    return LogitRecorder(engine)


def check_against_reference(hf, llm, prompts: list[list[int]], steps: int) -> None:
    rec = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    seqs_by_order = sorted(rec.by_request)  # requests are numbered in submission order
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.finish_reason == "length", o.error
        ref_logits = reference_logits(hf, p, o.token_ids)
        assert len(ref_logits) == steps
        k = comparable_prefix(ref_logits)
        assert k > 0, "the very first step is a near-tie; pick another prompt"
        # the reference's greedy choice at each step of this path: the first mismatch is
        # where kvfence left the reference's own greedy output
        ref_tokens = [int(l.argmax()) for l in ref_logits[:k]]
        assert o.token_ids[:k] == ref_tokens, f"prompt {i}: diverged before any near-tie"
        ours = rec.by_request[seqs_by_order[i]]
        for step in range(k):
            diff = (ours[step] - ref_logits[step]).abs().max().item()
            assert diff < LOGIT_TOL, f"prompt {i} step {step}: logits differ by {diff}"


def test_plain_prompts(hf_reference, make_llm):
    llm = make_llm()
    prompts = [llm.tokenizer.encode(t) for t in
               ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]]
    check_against_reference(hf_reference, llm, prompts, steps=24)


def test_chat_prompts(hf_reference, make_llm):
    llm = make_llm()
    convs = [[{"role": "user", "content": "What is the tallest mountain on Earth?"}],
             [{"role": "system", "content": "You answer in one word."},
              {"role": "user", "content": "Name a primary colour."}]]
    prompts = [llm.tokenizer.encode_chat(c) for c in convs]
    assert prompts[0][0] == llm.tokenizer.hf.token_to_id("<|im_start|>")
    check_against_reference(hf_reference, llm, prompts, steps=20)


def test_mixed_lengths_in_one_batch(hf_reference, make_llm):
    llm = make_llm()
    rng = random.Random(1)
    base = llm.tokenizer.encode("In a quiet village by the sea there lived an old fisherman who")
    prompts = [base[: rng.randint(3, len(base))] for _ in range(5)] + [base * 6]
    assert len({len(p) for p in prompts}) > 3
    check_against_reference(hf_reference, llm, prompts, steps=16)


def test_long_prompts_chunked_over_many_pages(hf_reference, make_llm):
    # a 64-token budget forces ~6 prefill chunks; 16-token pages: 20+ pages per request
    llm = make_llm(max_num_batched_tokens=64)
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and how knowledge travelled across Europe. ") * 12
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 300
    prompts = [ids, ids[:250]]
    check_against_reference(hf_reference, llm, prompts, steps=12)
    assert llm.engine.ledger.pages_for(len(ids)) > 18


def test_preempted_requests_match(hf_reference, make_llm):
    # 17 usable pages shared by 4 requests that each grow to 5 pages: preemption must happen
    llm = make_llm(kv_cache_memory=18 * 16 * 30 * 2 * 3 * 64 * 4, max_num_batched_tokens=512)
    prompts = [llm.tokenizer.encode(f"Story number {i}: once upon a time in a land far away, there was")
               for i in range(4)]
    engine = llm.engine
    assert engine.ledger.usable_pages == 17
    assert all(engine.ledger.pages_for(len(p) + 56) == 5 for p in prompts)
    check_against_reference(hf_reference, llm, prompts, steps=56)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    # the prompts share no whole page: every hit is a preempted request attaching its own pages
    assert engine.prefix_cache is not None and engine.prefix_cache.hits > 0
    assert engine.ledger.num_available == engine.ledger.usable_pages and engine.ledger.num_owned == 0
