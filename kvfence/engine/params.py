"""Per-request generation settings, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0.0 means greedy
    top_p: float = 1.0                # 0 keeps only the most likely token (OpenAI accepts 0)
    top_k: int = 0                    # 0 or -1: no top-k cut
    seed: int | None = None           # per-request RNG seed: same seed, same output
    max_tokens: int | None = 16       # None: up to the usable context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # number of top alternatives to return per token (0: only the chosen)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        problems = []
        if not (0.0 <= self.temperature <= 100.0):
            problems.append(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 <= self.top_p <= 1.0):
            problems.append(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (or -1 for no limit), got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            problems.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
