"""The bridge between the asyncio server and the single-threaded engine.

One background thread owns the engine: it builds it, runs the start-up checks, and then
loops `commands -> engine.step() -> deliver`. Nothing else ever calls an engine method.
The asyncio side talks to it only through a thread-safe command queue (submit, abort,
stop); the engine thread answers through `loop.call_soon_threadsafe` into each request's
asyncio.Queue, with immutable `Update`s (never the live Sequence). When there is no work
the thread blocks on the command queue; it never spins.

What the server shows about the engine (metrics, health, the isolation statement) comes
from `snapshot`, a fresh dict the engine thread publishes after every iteration.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfence.engine.admission import STARTUP_REFUSALS
from kvfence.engine.containment import FAIL_CLOSED
from kvfence.engine.params import SamplingParams
from kvfence.server.backend import Admitted, EngineFailed, Logprob, RequestHandle, Update, shut_out

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sequence import Sequence

log = logging.getLogger("kvfence.server.engine")


def cached_tokens_of(seq) -> int:
    """Prompt tokens served from the prefix cache: the one place the server reads it."""
    return int(getattr(seq, "cached_tokens", 0) or 0)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence
    sent_logprobs: int = 0
    sent_times: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    public_prefix_scope: str | None
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future
    updates: asyncio.Queue
    extra: dict | None = None     # further add_request arguments (PD: hold_kv, kv_source)
    behind: Retirement | None = None   # a retirement of its scope queued ahead of it (PD)


class ScopeNotRetired(EngineFailed):
    """A submission queued behind a retirement of its cache scope that did not happen: refused
    in the engine thread before add_request, so it never attaches the old party's pages."""


class Retirement:
    """A scope retirement queued in the engine's command order (EngineLoop.retire_soon). The
    event loop awaits `future`; `ran` is set in the engine thread when the command has run
    (True: it did, False: it raised), where a submission queued behind it reads it before it
    is admitted (found in review: checked after the submission came back, the request had
    already attached the old party's pages and run a step over them). Also the Outcome a
    PD node's ScopeGate keeps (pd/scope_epochs.py)."""

    def __init__(self) -> None:
        self.ran: bool | None = None
        self.future: asyncio.Future

    def done(self) -> bool:
        return self.future.done()

    def cancelled(self) -> bool:
        return self.future.cancelled()

    def exception(self) -> BaseException | None:
        return self.future.exception()

    def add_done_callback(self, fn: Callable[[Retirement], object]) -> None:
        self.future.add_done_callback(lambda _: fn(self))


@dataclass
class _Abort:
    request_id: str
    reason: str


@dataclass
class _EndAll:
    code: str      # the abort code every request in the engine ends with
    reason: str


@dataclass
class _Call:
    fn: Callable
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future


FAILED_THREAD_END_S = 10.0   # wait_ready's wait for a failed engine thread to end

_STOP = object()
_WAKE = object()   # something happened off the engine thread (a PD transfer notice)


class EngineLoop:
    """The single-node EngineBackend (server/backend.py)."""

    orders_choices = False   # the server submits the leads first; the engine holds the others (after)
    builds_grammars = True   # submit(grammar=...) reaches add_request: the engine thread compiles nothing

    def __init__(self, factory: Callable[[], LLMEngine], startup: Callable[[LLMEngine], list] | None = None,
                 name: str = "kvfence-engine"):
        """factory builds the engine inside the engine thread; startup(engine) runs the
        start-up checks there and returns their results (see isolation.py)."""
        self._factory = factory
        self._startup = startup
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._sinks: dict[str, _Sink] = {}
        self.ready = threading.Event()
        self.finished = threading.Event()   # the thread has exited
        self.error: str | None = None        # why the engine failed, if it did
        self.facts: dict | None = None       # static facts about the engine, set once it is built
        self.startup_checks: list[dict] = []
        self.snapshot: dict = {}
        self.tokenizer: Any = None
        self.iterations = 0                  # loop turns; stays put while idle (the thread blocks)
        # called (from the engine thread) once the engine has failed and every caller was
        # answered: serve() uses it to stop the process, so that a supervisor restarts it
        self.on_failure: Callable[[], None] | None = None
        # set by end_all: the abort code a submission gets from then on (a stopping server)
        self.closing: str | None = None

    # -- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> EngineLoop:
        if not self._thread.is_alive() and not self.finished.is_set():
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.finished.is_set():
            return "stopped"
        return "ready" if self.ready.is_set() else "loading"

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended (any thread; a moment's count)."""
        return len(self._sinks)

    def end_all(self, code: str, reason: str) -> int:
        """Take no more requests and end every one in the engine with abort code `code` (a
        stopping server's deadline, server/shutdown.py); returns how many were in it."""
        self.closing = code
        n = self.in_flight
        self._commands.put(_EndAll(code, reason))
        return n

    def wait_ready(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.ready.is_set():
            if self.error is not None or self.finished.is_set():
                # let the thread end first: a caller that returned at once exited the process
                # while the thread still let go of the half-built engine, and C++ aborted it
                # (SIGABRT, "terminate called without an active exception") where it should have
                # exited 2, a refused configuration (found by a docs probe, 1 in 6 under load)
                self.finished.wait(FAILED_THREAD_END_S)
                return False
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.ready.wait(0.1 if left is None else min(0.1, left))
        return True

    # -- requests (asyncio side) ----------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams, tenant: str,
                     request_id: str | None = None, public_prefix_scope: str | None = None,
                     scope_epoch: int = 0, behind: Retirement | None = None, grammar: LLMatcher | None = None,
                     after: str | None = None, **extra) -> RequestHandle:
        """Admit a request in the engine thread. Raises what add_request raises
        (ContextLengthExceeded, ValueError) or EngineFailed. `public_prefix_scope` only for a
        tenant whose tenants-file entry opts into that scope (I9). `scope_epoch` is for the PD
        wire (pd/scope_epochs.py): here a reload's retirement is ordered with every submission
        by this engine's one command queue. `behind`: a retirement of the request's scope
        queued before it; if it did not run, ScopeNotRetired, and the engine never sees the
        request. `grammar`: the schema's matcher (grammar.build_matcher), built by the caller off
        this loop and the engine thread. `after`: the choice of the same prompt whose prefill
        this one waits for (LLMEngine.add_request). The command is queued before the first await."""
        if self.state != "ready":
            raise EngineFailed(self.error or f"the engine is {self.state}")
        if self.closing is not None:
            raise shut_out(self.closing)
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        fut = loop.create_future()
        if grammar is not None:
            extra["grammar"] = grammar
        if after is not None:
            extra["after"] = after
        updates: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Submit(rid, list(prompt_ids), params, tenant, public_prefix_scope, loop, fut, updates,
                                   extra or None, behind))
        handle = RequestHandle(rid, updates)
        try:
            handle.admitted = await fut
        except asyncio.CancelledError:
            self.abort(rid, "client disconnected before admission")
            raise
        return handle

    def abort(self, request_id: str, reason: str = "client disconnected") -> None:
        """Thread-safe and idempotent: the engine thread aborts it if it is still running."""
        self._commands.put(_Abort(request_id, reason))

    async def forget_tenants(self, tenants: list[str], epoch: int = 0) -> int:
        """Retire these names' cache scopes (LLMEngine.forget_tenant) in the engine thread; after
        the aborts already queued, so their requests' references are gone first. `epoch`: as
        for submit."""
        if not tenants or self.state != "ready":
            return 0
        return await self.retire_soon(tenants).future

    def retire_soon(self, tenants: list[str], router: str | None = None) -> Retirement:
        """forget_tenants' command queued now, ahead of any submission queued after this call
        (a PD node retiring a scope before the request that showed it stale here; `router`:
        the scopes of that router's tenants, LLMEngine.add_request)."""
        retirement = Retirement()

        def retire(engine) -> int:   # in the engine thread
            try:
                pages = sum(engine.forget_tenant(t, router) for t in tenants)
            except BaseException:
                retirement.ran = False
                raise
            retirement.ran = True
            return pages
        retirement.future = self.call_soon(retire)
        return retirement

    async def call(self, fn: Callable):
        """Run fn(engine) in the engine thread and return its result (PD control messages)."""
        return await self.call_soon(fn)

    def call_soon(self, fn: Callable) -> asyncio.Future:
        """Queue fn(engine) for the engine thread now, in order with every other command; the
        future gets its result."""
        if self.state != "ready":
            raise EngineFailed(self.error or f"the engine is {self.state}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(_Call(fn, loop, fut))
        return fut

    # -- the engine thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._factory()
            engine.wake = lambda: self._commands.put(_WAKE)
            self.tokenizer = engine.tokenizer
            self.facts = engine_facts(engine)
            if self._startup is not None:
                self.startup_checks = self._startup(engine)
            self._publish(engine)
            self.ready.set()
            log.info("engine ready: %s", engine.context.note)
            self._serve(engine)
        except BaseException as e:  # noqa: BLE001 - whatever it was, fail closed and say why
            self.error = f"{type(e).__name__}: {e}"
            if not self.ready.is_set() and isinstance(e, STARTUP_REFUSALS):
                # the configuration cannot start: whoever waits for ready says why in one line
                log.debug("engine not started: %s\n%s", self.error, traceback.format_exc())
            else:
                log.error("engine thread failed: %s\n%s", self.error, traceback.format_exc())
            self._fail_all(EngineFailed(f"the engine failed: {self.error}"))
            self._drain_failed()
            if self.on_failure is not None and self.ready.is_set():
                self.on_failure()
        finally:
            self.ready.clear()
            self.finished.set()

    def _serve(self, engine) -> None:
        while True:
            cmds = []
            if not engine.has_unfinished():
                # idle: block, do not spin; wake for timed work (PD leases and fences)
                due = engine.next_timer()
                try:
                    cmds.append(self._commands.get(timeout=None if due is None else max(0.0, due - time.time())))
                except queue.Empty:
                    pass
            try:
                while True:
                    cmds.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for i, c in enumerate(cmds):
                if c is _STOP:
                    self._end_every(engine, "server shutting down")
                    self._publish(engine)
                    _refuse(cmds[i + 1:], EngineFailed("the engine is shutting down"))
                    return
                try:
                    if isinstance(c, _Submit):
                        self._admit(engine, c)
                    elif isinstance(c, _Abort):
                        self._abort(engine, c)
                    elif isinstance(c, _EndAll):
                        self._end_every(engine, c.reason, c.code)
                    elif isinstance(c, _Call):
                        self._call(engine, c)
                except BaseException as e:
                    # taken off the queue already: _drain_failed would not see them
                    _refuse(cmds[i + 1:], EngineFailed(f"the engine stopped: {e}"))
                    raise
            self._deliver(engine.step())
            self.iterations += 1
            self._publish(engine)

    def _admit(self, engine, c: _Submit) -> None:
        if c.behind is not None and c.behind.ran is not True:   # it ran before this, in this thread
            c.loop.call_soon_threadsafe(_set_exception, c.admitted, ScopeNotRetired(
                f"tenant {c.tenant!r}'s cache scope could not be retired here; the request was not run"))
            return
        if self.closing is not None:   # submitted just before end_all: it would outlive the deadline
            c.loop.call_soon_threadsafe(_set_exception, c.admitted, shut_out(self.closing))
            return
        try:
            extra = {"public_prefix_scope": c.public_prefix_scope} if c.public_prefix_scope else {}
            extra.update(c.extra or {})
            seq = engine.add_request(c.prompt_ids, c.params, tenant=c.tenant, request_id=c.request_id, **extra)
        except FAIL_CLOSED as e:   # the bookkeeping is wrong: the engine stops, not only this request
            c.loop.call_soon_threadsafe(_set_exception, c.admitted, EngineFailed(f"the engine stopped: {e}"))
            raise
        except Exception as e:  # noqa: BLE001 - admission errors go back to the caller
            c.loop.call_soon_threadsafe(_set_exception, c.admitted, e)
            return
        self._sinks[c.request_id] = _Sink(c.loop, c.updates, seq)
        c.loop.call_soon_threadsafe(_set_result, c.admitted,
                                    Admitted(c.request_id, len(seq.prompt_ids), seq.max_tokens))

    @staticmethod
    def _call(engine, c: _Call) -> None:
        try:
            value = c.fn(engine)
        except FAIL_CLOSED as e:   # as in _admit: a ledger or state-table refusal stops the engine
            c.loop.call_soon_threadsafe(_set_exception, c.result, EngineFailed(f"the engine stopped: {e}"))
            raise
        except Exception as e:  # noqa: BLE001 - goes back to the caller
            c.loop.call_soon_threadsafe(_set_exception, c.result, e)
            return
        c.loop.call_soon_threadsafe(_set_result, c.result, value)

    def _abort(self, engine, c: _Abort) -> None:
        if c.request_id in self._sinks:
            engine.abort(c.request_id, c.reason)
            self._finish_aborted(c.request_id)

    def _end_every(self, engine, reason: str, code: str = "client") -> None:
        """Every request in the engine ends, aborted with `code`, and its caller gets its last update."""
        for rid in list(self._sinks):
            engine.abort(rid, reason, code=code)
            self._finish_aborted(rid)

    def _finish_aborted(self, rid: str) -> None:
        sink = self._sinks.pop(rid)
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, self._update(sink, (), "", True))

    def _deliver(self, outputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.seq.request_id)
            if sink is None:
                continue
            u = self._update(sink, tuple(out.new_token_ids), out.delta_text, out.finished, out.event, out.data)
            if out.finished:
                del self._sinks[out.seq.request_id]
            by_loop.setdefault(sink.loop, []).append((sink.queue, u))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    @staticmethod
    def _update(sink: _Sink, token_ids: tuple, text: str, finished: bool, event: str | None = None,
                data: dict | None = None) -> Update:
        seq = sink.seq
        if event is not None and not token_ids:
            # a PD milestone (kv_held, kv_verified): the router reads only its event, so the
            # logprobs and times of a token the same step produced go with that token's update
            return Update((), text, finished, seq.finish_reason if finished else None,
                          seq.error if finished else None, len(seq.prompt_ids), len(seq.output_ids),
                          cached_tokens_of(seq), abort_code=seq.abort_code if finished else None,
                          event=event, data=data, started_at=seq.started_at)
        lps = _logprobs(seq.logprobs[sink.sent_logprobs:])
        sink.sent_logprobs = len(seq.logprobs)
        prompt_lps: tuple[Logprob, ...] = ()
        if (seq.params.prompt_logprobs is not None and not sink.sent_prompt_logprobs
                and len(seq.prompt_logprobs) >= len(seq.prompt_ids) - 1):
            prompt_lps, sink.sent_prompt_logprobs = _logprobs(seq.prompt_logprobs), True
        times = tuple(seq.token_times[sink.sent_times:])
        sink.sent_times = len(seq.token_times)
        return Update(token_ids, text, finished, seq.finish_reason if finished else None,
                      seq.error if finished else None, len(seq.prompt_ids), len(seq.output_ids),
                      cached_tokens_of(seq), lps, seq.first_token_at, times,
                      seq.abort_code if finished else None, event, data, prompt_lps, seq.started_at)

    def _publish(self, engine) -> None:
        s = engine.stats()
        s["ledger_counters"] = dict(engine.ledger.counters)
        s["scrub"] = engine.ledger.scrub.value
        s["read_checks"] = bool(engine.ledger.checks_enabled)
        s["published_at"] = time.time()
        self.snapshot = s

    def _fail_all(self, exc: BaseException) -> None:
        for sink in list(self._sinks.values()):
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, exc)
        self._sinks.clear()

    def _drain_failed(self) -> None:
        """After a failure, answer anything still queued so no caller waits forever."""
        left = []
        try:
            while True:
                left.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        _refuse(left, EngineFailed(self.error or "failed"))


def default_model_name(path) -> str:
    """What clients call the model unless --served-model-name says otherwise: the GGUF file's
    name without its quantization tag, or the Hugging Face folder's name."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        return p.name
    return re.sub(r"\.(i?q\d\w*|f16|f32|bf16)$", "", p.stem, flags=re.IGNORECASE)


def engine_facts(engine) -> dict:
    """Static facts the server reports (model, pool, context); read once, in the engine thread."""
    c, led, cfg = engine.model_config, engine.ledger, engine.config
    return {
        "model_name": c.name, "model_path": str(engine.model_path),
        "default_served_name": default_model_name(engine.model_path), "fingerprint": c.fingerprint(),
        "dtype": cfg.dtype, "weights": engine.model.weights_mode,   # what runs, not what was asked
        "compute": engine.compute_path, "matmul": engine.matmul_path, "kernels": engine.kernels_state,
        "device": str(engine.device), "page_size": led.page_size,
        "pool_pages": led.usable_pages, "pool_tokens": led.capacity_tokens, "pool_bytes": engine.pool.nbytes,
        "model_max_context": engine.context.model_max, "configured_max_model_len": engine.context.configured,
        "usable_context": engine.usable_context, "context_clamped": engine.context.clamped,
        "context_note": engine.context.note, "scrub": led.scrub.value, "read_checks": bool(led.checks_enabled),
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "tenant_waiting_places": cfg.tenant_waiting_places,
        "vocab_size": c.vocab_size,
        "prefix_cache": getattr(engine, "prefix_cache", None) is not None,
        **({"pd": pd} if (pd := engine.kv_link.facts()) is not None else {}),
    }


def _logprobs(lps) -> tuple[Logprob, ...]:
    return tuple(Logprob(lp.token_id, float(lp.logprob), tuple((int(t), float(v)) for t, v in lp.top)) for lp in lps)


def _refuse(cmds: list, exc: EngineFailed) -> None:
    """Answer the submits and calls among `cmds` with `exc` (they will not run)."""
    for c in cmds:
        if isinstance(c, _Submit):
            c.loop.call_soon_threadsafe(_set_exception, c.admitted, exc)
        elif isinstance(c, _Call):
            c.loop.call_soon_threadsafe(_set_exception, c.result, exc)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _put_all(items) -> None:
    for q, u in items:
        q.put_nowait(u)
