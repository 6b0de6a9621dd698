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


def reference(hf, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [l[0].float() for l in out.logits]


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
        ref_tokens, ref_logits = reference(hf, p, steps)
        k = comparable_prefix(ref_logits)
        assert k > 0, "the very first step is a near-tie; pick another prompt"
        assert o.token_ids[:k] == ref_tokens[:k], f"prompt {i}: diverged before any near-tie"
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
    # 26 usable pages shared by 4 requests that each grow to ~7 pages: preemption must happen
    llm = make_llm(kv_cache_memory=27 * 16 * 30 * 2 * 3 * 64 * 4, max_num_batched_tokens=512)
    prompts = [llm.tokenizer.encode(f"Story number {i}: once upon a time in a land far away, there was")
               for i in range(4)]
    engine = llm.engine
    assert engine.ledger.usable_pages == 26
    check_against_reference(hf_reference, llm, prompts, steps=90)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.ledger.num_available == engine.ledger.usable_pages and engine.ledger.num_owned == 0
