"""The prefill cap while decoding, sized from a step-time target.

Every stream that decodes in a step waits for the whole step, so the gap between its tokens is
the step's time. A step costs about a + b * p: a for its decode rows (the weights are read once
a step whatever its rows), b for each of its p prefill tokens. b differs several times between
machines for the same model (bf16, 2 threads: ~0.5 ms a prompt token on a Zen 4, ~2.5 ms on a
Zen 3 with the long prompts' attention), so no one token cap keeps steps under a time target
everywhere: 256 tokens is ~165 ms on the first and ~650 ms on the second (docs/performance.md).

The engine therefore learns a and b from the steps it runs (moving averages: a from steps that
only decode, b from steps that decode and prefill at least a page) and caps a step's prefill at
the whole pages that fit the target, between one page (prompts always progress) and the
configured token cap (the ceiling). A step that only prefills (a prompt into an idle engine)
gives a first, high guess of b (its time over its tokens: a's share included) until a step that
decodes and prefills prices it; until it has a and b the cap is the ceiling.
The target is for the slow steps (the ITL p99), not the average one: steps of the same size
scatter by ~5% (the chunk's place in its prompt, the decode rows, the machine). The scatter is
learned as the mean relative miss of the prediction, and the cap is planned for
target / (1 + 3 x scatter): for a normal spread the mean absolute miss is ~0.8 sigma, so three
of them are ~2.4 sigma, its 99th percentile.
The schedule then depends on timing, which is why tests that need exact steps set
`decode_step_target_ms=0` (the fixed token cap).
"""
from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2   # weight of the newest step in the moving averages: follows a load change in ~5 steps
SPREAD = 3.0  # mean absolute misses between the planned step and the target (the p99 of a normal spread)


@dataclass
class StepTarget:
    target_s: float     # a step that decodes should take at most this long
    ceiling: int        # the configured prefill cap while decoding (tokens)
    page: int           # the cap moves in whole pages, and is never below one
    base_s: float | None = None       # a decode-only step
    per_token_s: float | None = None  # one prefill token in a step that also decodes
    scatter: float = 0.0              # mean |actual / predicted - 1| of the steps that prefilled

    def __post_init__(self) -> None:
        if not (self.target_s > 0 and self.ceiling >= self.page > 0):
            raise ValueError(f"step target: target_s > 0 and ceiling >= page > 0; got {self}")

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step that ran: its prefill tokens, decode rows and wall time."""
        if seconds <= 0:
            return
        if decode_rows <= 0:   # no stream waited on it: only a first guess of a token's cost
            if self.per_token_s is None and prefill_tokens >= self.page:
                self.per_token_s = seconds / prefill_tokens
            return
        if prefill_tokens == 0:
            self.base_s = _ewma(self.base_s, seconds)
        elif prefill_tokens >= self.page and self.base_s is not None:
            if self.per_token_s:
                predicted = self.base_s + self.per_token_s * prefill_tokens
                self.scatter = _ewma(self.scatter, abs(seconds / predicted - 1.0))
            self.per_token_s = _ewma(self.per_token_s, max(0.0, seconds - self.base_s) / prefill_tokens)

    @property
    def cap(self) -> int:
        """Prefill tokens a step that decodes may hold now."""
        if self.base_s is None or not self.per_token_s:
            return self.ceiling
        room = (self.target_s / (1.0 + SPREAD * self.scatter) - self.base_s) / self.per_token_s
        pages = int(room // self.page) if room > 0 else 0
        return max(self.page, min(self.ceiling, pages * self.page))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
