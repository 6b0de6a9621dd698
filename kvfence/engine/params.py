"""Per-request generation settings, validated once at construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# a JSON schema for structured output, as compact JSON (the API's and the PD wire's bound)
MAX_JSON_SCHEMA_BYTES = 64 << 10
# below it a seen token's positive logit divided by the penalty overflows float32 to inf, and
# sampling gets NaN (1e-300 was a 500); a factor that small already makes seen tokens certain
MIN_REPETITION_PENALTY = 0.01
# stop strings and stop token ids: the API's and the PD wire's bounds (one place, so a request
# a single node takes is one the router can hand to its nodes)
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_TOKEN_ID = (1 << 31) - 1


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0.0 means greedy
    top_p: float = 1.0                # 0 keeps only the most likely token (OpenAI accepts 0)
    top_k: int = 0                    # 0 or -1: no top-k cut
    seed: int | None = None           # per-request RNG seed: same seed, same output
    max_tokens: int | None = 16       # None: up to the usable context; 0: compute the prompt, sample nothing
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # number of top alternatives to return per token (0: only the chosen)
    # the prompt's own logprobs (vLLM's prompt_logprobs): for each prompt token after the first,
    # its logprob given the tokens before it and this many top alternatives (0: only the token)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's penalties on tokens generated so far (-2..2), vLLM's repetition penalty on prompt
    # and output tokens (1: none), min_p, min_tokens and logit_bias (engine/logits_processors.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # structured output: every token constrained to this JSON schema (engine/grammar.py); a
    # dict or JSON text, held as compact JSON (keys in the given order: they order the output)
    json_schema: str | dict[str, Any] | None = None

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
        if self.max_tokens is not None and self.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not (0 <= getattr(self, name) <= 20):
                problems.append(f"{name} must be in [0, 20], got {getattr(self, name)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        elif any(len(s) > MAX_STOP_CHARS for s in self.stop):
            problems.append(f"stop strings may be at most {MAX_STOP_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or \
                any(not 0 <= t <= MAX_STOP_TOKEN_ID for t in self.stop_token_ids):
            problems.append(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids in [0, {MAX_STOP_TOKEN_ID}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0):
            problems.append(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], "
                            f"got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if len(self.logit_bias) > 1024:
            problems.append("logit_bias may name at most 1024 tokens")
        if any(k < 0 for k in self.logit_bias) or any(not (-100.0 <= v <= 100.0) for v in self.logit_bias.values()):
            problems.append("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if self.json_schema is not None:
            try:
                self.json_schema = canonical_schema(self.json_schema)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Do repetition, frequency or presence penalties read this request's token counts?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Does anything change this request's logits before it samples?"""
        return self.penalizes or bool(self.min_tokens or self.logit_bias or self.json_schema is not None)


def canonical_schema(schema: Any) -> str:
    """One text form of a JSON schema (dict or JSON text): compact, keys in the given order
    (llguidance emits properties in schema order, so sorting them would change the output).
    ValueError unless it is a JSON object within MAX_JSON_SCHEMA_BYTES."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("json_schema must be a JSON object")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:   # allow_nan=False: a literal like 1e999 parses to infinity
        raise ValueError("json_schema holds a number out of range (infinite or NaN)") from None
    except (TypeError, RecursionError) as e:
        raise ValueError(f"json_schema is not JSON: {e}") from None
    if len(text.encode()) > MAX_JSON_SCHEMA_BYTES:
        raise ValueError(f"json_schema is larger than {MAX_JSON_SCHEMA_BYTES} bytes as compact JSON")
    return text
