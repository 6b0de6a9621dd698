"""Turns a batch of logits into next tokens, plus logprobs when a request asks.

Rows that ask are adjusted first (logit_bias, min_tokens, penalties: logits_processors.py).
Greedy rows take the argmax (first index on ties). Sampled rows apply temperature,
top-k, top-p, then min_p, and draw with their own generator, so a seeded request's tokens
depend only on its seed and its own logits, never on the rest of the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvfence.engine.logits_processors import History, adjust
from kvfence.engine.params import SamplingParams
from kvfence.kernels import cpu_kernels

# Below this, logits / temperature can overflow to inf; such rows are greedy (as in vLLM).
GREEDY_EPS = 1e-5


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float                     # log_softmax of the raw logits (before temperature/top-k/top-p)
    top: list[tuple[int, float]]       # params.logprobs best (token_id, logprob), highest first


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request did not ask for logprobs


def score_tokens(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """Each row's logprob of its given token and its `top` best alternatives, from the
    row's raw logits: a prompt's own logprobs (params.prompt_logprobs). The same
    computation as a sampled token's (Sampler._logprobs), so a prompt token scores what
    it would score if it were sampled at that position."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = lsm.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(top, lsm.shape[1])
    if k <= 0:
        return [TokenLogprobs(t, lp, []) for t, lp in zip(token_ids, chosen)]
    top_v, top_i = lsm.topk(k, dim=-1)
    return [TokenLogprobs(t, lp, list(zip(ti, tv))) for t, lp, ti, tv in
            zip(token_ids, chosen, top_i.tolist(), top_v.tolist())]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request's draws; None (global RNG) when it has no seed."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # manual_seed only takes 64-bit values
    return g


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax; the CPU kernel's where it applies (same answer, ~10x faster)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[1]:
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_EPS


class Sampler:
    def __init__(self) -> None:
        self.adjust_seconds = 0.0   # time in logit adjustments and grammar masks (bench --structured)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[History] | None = None,
    ) -> SampleOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"batch of {batch} logits rows, {len(params)} params, {len(generators)} generators"
            )

        raw = logits     # logprobs describe the model's own distribution, not the adjusted one
        if histories is not None:
            t0 = time.perf_counter()
            logits = adjust(logits, params, histories)
            self.adjust_seconds += time.perf_counter() - t0
        elif any(p.adjusts_logits for p in params):
            raise ValueError("penalties, logit_bias and min_tokens need each row's history")

        # Hot path: one argmax for the whole batch. float32 conversion cannot change the
        # order of fp16/bf16 values, so argmax on the raw dtype is the same answer, minus a copy.
        if all(p.temperature < GREEDY_EPS and p.logprobs is None for p in params):
            return SampleOutput(_argmax(logits).tolist(), [None] * batch)

        device = logits.device
        greedy_rows = [i for i, p in enumerate(params) if _is_greedy(p)]
        sampled_rows = [i for i, p in enumerate(params) if not _is_greedy(p)]

        if not sampled_rows:
            chosen = _argmax(logits)
        else:
            chosen = torch.empty(batch, dtype=torch.long, device=device)
            if greedy_rows:
                g_idx = torch.tensor(greedy_rows, device=device)
                chosen[g_idx] = logits.index_select(0, g_idx).argmax(dim=-1)
            s_idx = torch.tensor(sampled_rows, device=device)
            chosen[s_idx] = self._sample(
                logits.index_select(0, s_idx).float(),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )

        token_ids = chosen.tolist()
        return SampleOutput(token_ids, self._logprobs(raw, params, chosen, token_ids))

    def _sample(
        self, x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """x: float32 [S, V] copy of the sampled rows' logits (modified in place)."""
        device = x.device
        n, vocab = x.shape
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        x.div_(temps.unsqueeze(1))
        x = self._top_k_top_p(x, params)
        probs = torch.softmax(x, dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):   # vLLM's min_p: drop tokens below min_p x the most likely one's probability
            floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)

        # Each seeded row draws alone from its own generator: its stream of draws then
        # does not depend on batch size, position, or other requests.
        out = torch.empty(n, dtype=torch.long, device=device)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if unseeded:
            u_idx = torch.tensor(unseeded, device=device)
            out[u_idx] = torch.multinomial(probs.index_select(0, u_idx), 1).squeeze(1)
        for j, g in enumerate(generators):
            if g is not None:
                out[j] = torch.multinomial(probs[j], 1, generator=g)[0]
        return out

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        n, vocab = x.shape
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # top_p == 1 keeps everything; an infinite threshold avoids float cumsum drift at the tail.
        ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        need_k = any(k < vocab for k in ks)
        need_p = any(p != float("inf") for p in ps)
        if not (need_k or need_p):
            return x

        device = x.device
        # Stable descending sort ranks ties by lowest index first, like argmax, so
        # top_k=1 and a tiny top_p reduce exactly to greedy.
        sorted_x, sorted_idx = torch.sort(x, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if need_k:
            remove |= rank >= torch.tensor(ks, device=device).unsqueeze(1)
        if need_p:
            sorted_probs = torch.softmax(sorted_x.masked_fill(remove, float("-inf")), dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Keep a token only while the better-ranked tokens have not yet reached top_p.
            remove |= mass_before >= torch.tensor(ps, dtype=torch.float32, device=device).unsqueeze(1)
            remove[:, 0] = False
        filtered = sorted_x.masked_fill(remove, float("-inf"))
        return torch.empty_like(x).scatter_(1, sorted_idx, filtered)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], chosen: torch.Tensor, token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        batch = len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * batch
        if not rows:
            return result
        idx = torch.tensor(rows, device=logits.device)
        # Reported logprobs come from the unmodified distribution, as OpenAI and vLLM report them.
        lsm = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        chosen_lp = lsm.gather(1, chosen.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
        n_top = min(max(params[i].logprobs or 0 for i in rows), lsm.shape[1])
        if n_top > 0:
            top_v, top_i = lsm.topk(n_top, dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            k = min(params[i].logprobs, n_top)
            top = list(zip(top_i[j][:k], top_v[j][:k])) if k > 0 else []
            result[i] = TokenLogprobs(token_ids[i], chosen_lp[j], top)
        return result
