"""The declared boundary between the HTTP app (server/app.py) and what serves its requests.

Two backends implement `EngineBackend`: `EngineLoop` (one engine in this process) and the
PD router's `RouterBackend` (requests go to prefill and decode nodes). The app uses
nothing else of either. What crosses the boundary is immutable data (`Update`,
`Admitted`) and errors that carry their code and numbers as fields: `submit` raises
`ContextLengthExceeded` (400, with the limit), `ValueError` (400) or `EngineFailed` (with
a code the app maps to a status).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvfence.engine.params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Update:
    """What one engine iteration produced for one request."""
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple[Logprob, ...] = ()
    first_token_at: float | None = None
    token_times: tuple[float, ...] = ()
    abort_code: str | None = None
    event: str | None = None      # PD: kv_held (data: the manifest), kv_verified, kv_failed
    data: dict | None = None
    # params.prompt_logprobs: prompt tokens 1.. (the first has none), once, in the first
    # update after the prompt was computed
    prompt_logprobs: tuple[Logprob, ...] = ()
    started_at: float | None = None   # when the engine first ran it (perf_counter); None: not yet, or unknown


@dataclass
class Admitted:
    request_id: str
    prompt_tokens: int
    max_tokens: int


class EngineFailed(RuntimeError):
    """The backend cannot take or finish the request. `code` says why, machine-readably
    (engine_unavailable, or a PD router's node_* and kv_* codes); app.py maps it to a status."""

    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__(message)
        self.code = code


def shut_out(code: str) -> EngineFailed:
    """What a submission gets once a stopping server has ended the requests in flight
    (EngineBackend.end_all): the stop's abort code."""
    return EngineFailed("it came after the stop had ended the requests in flight", code=code)


class NotServedHere(ValueError):
    """A well-formed request this backend cannot serve (prompt scoring behind the PD router):
    the client's 400, with a code a client can act on (send it to a single node)."""
    code = "unsupported_behind_router"


@dataclass
class RequestHandle:
    request_id: str
    updates: asyncio.Queue
    admitted: Admitted | None = None
    done: bool = False

    @property
    def admission(self) -> Admitted:
        """What admission granted; submit() returns only admitted handles."""
        if self.admitted is None:
            raise RuntimeError(f"request {self.request_id} was not admitted")
        return self.admitted

    async def next(self) -> Update:
        u = await self.updates.get()
        if isinstance(u, BaseException):
            self.done = True
            raise u
        if u.finished:
            self.done = True
        return u


# the states in which a backend's process cannot serve again by waiting: a liveness probe
# fails only in these, so that a supervisor restarts it. A router whose nodes are down
# (not_ready) is alive: restarting it would not bring them back and would cut what it serves
DEAD_STATES = ("failed", "stopped")


class EngineBackend(Protocol):
    facts: dict[str, Any] | None        # static facts (model, pool, context), once known
    snapshot: dict[str, Any]            # live counts, refreshed by the backend
    startup_checks: list[dict[str, Any]]
    tokenizer: Any                      # kvfence.model.tokenizer.KvTokenizer, once loaded
    # whether submit's `grammar` (a schema's matcher, built off the engine thread) is used here;
    # the PD router's decode nodes build their own (pd/node.py)
    builds_grammars: bool
    # whether submit itself starts a choice `after` its lead once the lead's prompt is computed,
    # so a request's choices may all be submitted at once (the PD router, whose submit lasts
    # until decode has the KV); else the server submits the leads first, then the others
    orders_choices: bool

    @property
    def state(self) -> str: ...         # loading | ready | not_ready | failed | stopped

    @property
    def error(self) -> str | None: ...  # why it is not serving, if it is not

    def start(self) -> EngineBackend: ...
    def stop(self, timeout: float = 30.0) -> None: ...
    def wait_ready(self, timeout: float | None = None) -> bool: ...

    async def submit(self, prompt_ids: list[int], params: SamplingParams, tenant: str,
                     request_id: str | None = None, public_prefix_scope: str | None = None,
                     scope_epoch: int = 0, *,                  # Tenant.scope_epoch
                     grammar: LLMatcher | None = None,
                     # another choice of the same prompt, submitted just before: start after its
                     # prefill, attaching its prompt pages (n > 1; every choice is admitted at once)
                     after: str | None = None) -> RequestHandle: ...

    def abort(self, request_id: str, reason: str = "client disconnected") -> None: ...

    @property
    def in_flight(self) -> int: ...     # requests submitted and not yet ended (a moment's count)

    # a stopping server's deadline (server/shutdown.py), from any thread: take no more requests and
    # end every one in flight with abort code `code`; returns how many there were
    def end_all(self, code: str, reason: str) -> int: ...

    # retire names' cache scopes (pages retired); epoch: the reload's number (TenantRegistry.reloads)
    async def forget_tenants(self, tenants: list[str], epoch: int) -> int: ...
