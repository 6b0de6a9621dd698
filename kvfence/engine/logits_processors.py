"""What changes a request's next-token logits before it samples, by OpenAI's and vLLM's
definitions, applied to a float32 copy of the rows that ask (greedy rows too):

- logit_bias: the value added to that token's logit (-100 bans it, +100 all but forces it);
- min_tokens: the end-of-sequence and stop tokens cannot be chosen before that many tokens;
- repetition_penalty r (vLLM/HF, over prompt and output tokens): a positive logit is divided
  by r, a negative one multiplied by it;
- frequency_penalty f and presence_penalty p (OpenAI, over the tokens generated so far):
  logit -= f * count(token) + p * (count(token) > 0);
- json_schema (structured output): every token its grammar does not allow next is -inf, the
  end-of-sequence ones until the grammar accepts (engine/grammar.py), last, so no bias can
  bring a forbidden token back.

The logprobs a request returns stay those of the model's own distribution (sampler.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfence.engine.grammar import Constraint, fill_bitmask, mask_bias
from kvfence.engine.params import SamplingParams
from kvfence.kernels import cpu_kernels


@dataclass(frozen=True)
class History:
    """What a row's adjustments look at: the request's prompt and the tokens it generated,
    and the tokens min_tokens holds back (end-of-sequence and stop token ids); a structured
    output request's grammar at its current position."""
    prompt_ids: list[int]
    output_ids: list[int]
    end_ids: frozenset[int]
    grammar: Constraint | None = None


def adjust(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """The logits with every row's adjustments applied: the input itself when no row asks,
    else a float32 copy."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    vocab = out.shape[1]
    for i in rows:
        p, h, row = params[i], histories[i], out[i]
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt_ids) | set(h.output_ids)), dtype=torch.long, device=row.device)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and h.output_ids:
            counts = torch.bincount(torch.tensor(h.output_ids, dtype=torch.long, device=row.device),
                                    minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.min_tokens and len(h.output_ids) < p.min_tokens:
            ends = [t for t in h.end_ids if t < vocab]
            row[ends] = float("-inf")
    constrained = [i for i in rows if histories[i].grammar is not None]
    if constrained:
        apply_grammar(out, constrained, [histories[i].grammar for i in constrained])
    return out


def apply_grammar(out: torch.Tensor, rows: list[int], grammars) -> None:
    """-inf, in place, on every token the rows' grammars do not allow next: all rows' masks in
    one call (llguidance spreads them over its threads), then the CPU kernel that writes
    straight from the bitmask, or else (CUDA, no kernels) one 0/-inf bias added to the rows."""
    idx = torch.tensor(rows, dtype=torch.long, device=out.device)
    kernels = cpu_kernels() if out.device.type == "cpu" and out.is_contiguous() else None
    if kernels is not None:
        kernels.apply_token_mask(out, idx, fill_bitmask(grammars))
        return
    bias = mask_bias(grammars, out.shape[1]).to(out.device)
    if len(rows) == out.shape[0]:
        out += bias
    else:
        out.index_add_(0, idx, bias)
