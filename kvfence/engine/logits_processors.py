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

from kvfence.engine.grammar import Constraint, GrammarLimit, fill_bitmask, mask_bias
from kvfence.engine.params import SamplingParams
from kvfence.kernels import cpu_kernels


class TokenCounts:
    """A request's output-token counts and which tokens its prompt or output holds, kept a
    token at a time. Rebuilt from the whole history every step, they cost O(history) a row:
    ~2.4 ms a step per row with an 8K-token history, which a tenant's n=16 put on every step."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None   # int32 [vocab]: times each token was generated
        self.seen: torch.Tensor | None = None     # bool [vocab]: in the prompt or the output
        self._taken = 0                            # output tokens counted so far

    def update(self, prompt_ids: list[int], output_ids: list[int], vocab: int, device) -> None:
        if self.counts is None or self.counts.numel() != vocab or len(output_ids) < self._taken:
            self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._mark(prompt_ids, count=False)
            self._taken = 0
        self._mark(output_ids[self._taken:], count=True)
        self._taken = len(output_ids)

    def _mark(self, ids: list[int], count: bool) -> None:
        if not ids:
            return
        assert self.counts is not None and self.seen is not None
        t = torch.tensor(ids, dtype=torch.long, device=self.counts.device)
        t = t[(t >= 0) & (t < self.counts.numel())]
        self.seen[t] = True
        if count:
            self.counts.index_add_(0, t, torch.ones_like(t, dtype=torch.int32))


class FixedAdjustments:
    """A request's logit_bias and the ids min_tokens holds back, as index tensors, built at its
    first step and kept: rebuilt from the dict and set every step they cost ~0.5 ms a row, 8.4
    ms a step for n=16 with 1,024 biases and 1,024 stop ids each, on every tenant's step."""

    def __init__(self, held_back: frozenset[int]) -> None:
        self.held_back = held_back          # end-of-sequence and stop token ids
        self._for: tuple | None = None      # (vocab, device) the tensors were built for
        self.bias_ids = self.bias_values = self.held_ids = torch.empty(0)

    def tensors(self, p: SamplingParams, vocab: int, device) -> FixedAdjustments:
        if self._for != (vocab, device):
            ids = [t for t in p.logit_bias if t < vocab]
            self.bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
            self.bias_values = torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32, device=device)
            self.held_ids = torch.tensor(sorted(t for t in self.held_back if t < vocab), dtype=torch.long,
                                         device=device)
            self._for = (vocab, device)
        return self


@dataclass(frozen=True)
class History:
    """What a row's adjustments look at: the request's prompt and the tokens it generated,
    and the tokens min_tokens holds back (end-of-sequence and stop token ids); a structured
    output request's grammar at its current position."""
    prompt_ids: list[int]
    output_ids: list[int]
    end_ids: frozenset[int]
    grammar: Constraint | None = None
    counts: TokenCounts | None = None   # the request's own, kept across steps (None: counted afresh)
    fixed: FixedAdjustments | None = None   # the request's own, kept (None: built afresh from end_ids)


def adjust(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """The logits with every row's adjustments applied: the input itself when no row asks,
    else a float32 copy."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    vocab = out.shape[1]
    held_rows = []
    for i in rows:
        p, h, row = params[i], histories[i], out[i]
        held = bool(p.min_tokens) and len(h.output_ids) < p.min_tokens
        if held:
            held_rows.append(i)
        fixed = None
        if p.logit_bias or held:
            fixed = (h.fixed or FixedAdjustments(h.end_ids)).tensors(p, vocab, row.device)
        if p.logit_bias:
            assert fixed is not None
            row.index_add_(0, fixed.bias_ids, fixed.bias_values)
        if p.penalizes:
            tc = h.counts if h.counts is not None else TokenCounts()
            tc.update(h.prompt_ids, h.output_ids, vocab, row.device)
            assert tc.counts is not None and tc.seen is not None
            if p.repetition_penalty != 1.0:
                scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(tc.seen, scaled, row))
            if (p.frequency_penalty or p.presence_penalty) and h.output_ids:
                counts = tc.counts.to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if held:
            assert fixed is not None
            row[fixed.held_ids] = float("-inf")
    constrained = [i for i in rows if histories[i].grammar is not None]
    if constrained:
        apply_grammar(out, constrained, [histories[i].grammar for i in constrained])
        for i in held_rows:   # the client's two constraints leave no token (found in review: a 500)
            if histories[i].grammar is not None and bool(torch.isneginf(out[i]).all()):
                raise GrammarLimit("the schema allows no next token but end-of-sequence or 'stop_token_ids' ones, "
                                   "which 'min_tokens' holds back")
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
