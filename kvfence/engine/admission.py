"""Admission (I4) and context capacity (I8): decided before any page is granted."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvfence import faults

log = logging.getLogger("kvfence.admission")


class ContextLengthExceeded(ValueError):
    """prompt + max_tokens does not fit the usable context. Carries both numbers."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        super().__init__(self.said_as("the prompt", "max_tokens"))

    def said_as(self, prompt_param: str, max_param: str) -> str:
        """The message with the request's own names for its prompt and completion limit."""
        return (f"This model's maximum context length is {self.limit} tokens. However, you requested "
                f"{self.prompt_tokens + self.max_tokens} tokens ({self.prompt_tokens} in the prompt, "
                f"{self.max_tokens} for the completion). Please reduce {prompt_param} or {max_param}.")


class Overloaded(RuntimeError):
    """Too many requests wait already (for this node, or for this tenant's share of it): shed
    early, with a retry hint, instead of queueing without bound."""

    code = "server_overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def completion_tokens(max_tokens: int | None, prompt_tokens: int, usable: int) -> int:
    """The most completion tokens a request may generate: its max_tokens, or the rest of the
    context when it sets none (at least 1: a prompt that leaves none is refused by I4). The one
    rule the engine, the PD router and the server's reservations follow."""
    return max_tokens if max_tokens is not None else max(1, usable - prompt_tokens)


class CapacityError(RuntimeError):
    """The advertised context does not fit the KV pool (the incident's misconfiguration)."""


# what a configuration that cannot start raises (a context past the pool, a size or setting
# that does not parse, a model path or file that is not there): the message says what to
# change, so the commands say it in one line, and the traceback only under -v
STARTUP_REFUSALS = (CapacityError, ValueError, OSError)   # OSError: FileNotFoundError among them


@dataclass(frozen=True)
class ContextPlan:
    usable: int            # the limit every request is admitted against
    model_max: int
    configured: int | None
    pool_tokens: int
    clamped: bool
    note: str


def plan_context(model_max: int, configured: int | None, pool_tokens: int, clamp: bool) -> ContextPlan:
    """usable = min(model max, configured max, pool capacity); refuse to start when the
    configured (or, if none, the model's) context exceeds the pool, unless clamping is asked for."""
    wanted = configured if configured is not None else model_max
    if configured is not None and configured > model_max:
        raise CapacityError(f"--max-model-len {configured} exceeds the model's context of {model_max} tokens")
    if wanted <= pool_tokens:
        return ContextPlan(wanted, model_max, configured, pool_tokens, False,
                           f"context {wanted} tokens fits the KV pool of {pool_tokens} tokens")
    if not clamp:
        raise CapacityError(
            f"advertised context {wanted} tokens exceeds the KV pool capacity of {pool_tokens} tokens; "
            f"give the pool more memory (--kv-cache-memory), lower --max-model-len, "
            f"or pass --clamp-context to serve {pool_tokens} tokens")
    note = f"context clamped from {wanted} to {pool_tokens} tokens to fit the KV pool (--clamp-context)"
    log.warning(note)
    return ContextPlan(pool_tokens, model_max, configured, pool_tokens, True, note)


def check_fits(prompt_tokens: int, max_tokens: int, usable: int) -> None:
    """I4: the whole request must fit before anything is allocated for it."""
    if prompt_tokens < 1:
        raise ValueError("the prompt is empty: send at least one token")
    if prompt_tokens + max_tokens > usable and not faults.active("skip_node_admission"):
        raise ContextLengthExceeded(prompt_tokens, max_tokens, usable)
