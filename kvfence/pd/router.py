"""The PD router: the OpenAI API in front of one prefill and one decode node.

It plugs into the same HTTP app as single-node `serve` (server/app.py) by offering the
engine loop's interface (state, facts, snapshot, tokenizer, submit, abort), so auth,
tenant limits, streaming, errors and metrics are the same code. What differs is submit:

  router admission (I4, against the cluster's checked capacity, I8; app.py does it)
  -> prefill: admit (node I4), compute, hold; returns the manifest       [skipped for a 1-token prompt]
  -> decode: admit (node I4), check the manifest, reserve, pull, verify (I5), generate
  -> on kv_verified: ACK to prefill (RELEASE)
  -> on any failure or client disconnect: abort on both sides; prefill frees the rows at
     once only if decode said no pull can be running, else it fences them (I6)

A node that answers nothing for `stall_s` (nodes send a heartbeat every second) fails the
request with a clear error, so a hung node never hangs a client. A monitor polls every
node each second: a node that stops answering makes the router not ready (503), and a
node that comes back with a new boot id is checked again (I8) before it serves.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded
from kvfence.engine.params import SamplingParams
from kvfence.pd.capacity import ClusterCheck, check_cluster
from kvfence.pd.messages import (
    AbortBody,
    AdmittedEvent,
    DecodeBody,
    FailedEvent,
    Handoff,
    Manifest,
    MessageError,
    NodeInfo,
    PrefillBody,
    ProgressEvent,
    RejectedEvent,
    ReleaseBody,
    StopPullBody,
    StopPullReply,
    TransferSource,
    WaitEvent,
    WireModel,
    WireParams,
    parse_event,
)
from kvfence.pd.settings import ROLES
from kvfence.pd.tls import TlsSettings, client_context, uvicorn_options
from kvfence.pd.wire import cluster_headers
from kvfence.server.backend import Admitted, EngineFailed, Logprob, RequestHandle, Update
from kvfence.server.http_limits import HttpLimits, uvicorn_server

log = logging.getLogger("kvfence.pd.router")


def load_router_tokenizer(model: str | None):
    """The tokenizer alone (no weights): from the GGUF's metadata or the folder's tokenizer.json."""
    from kvfence.model.loader import default_model_path

    p = Path(model) if model else default_model_path()
    if p.is_dir():
        from kvfence.model.tokenizer import tokenizer_from_hf_folder
        return tokenizer_from_hf_folder(p)
    from kvfence.model.gguf_loader import read_metadata
    from kvfence.model.tokenizer import tokenizer_from_gguf_metadata
    return tokenizer_from_gguf_metadata(read_metadata(p))


class NodeError(RuntimeError):
    """A node refused or failed the request; `rejection` is the node's own refusal, if any."""

    def __init__(self, message: str, code: str, rejection: RejectedEvent | None = None):
        super().__init__(message)
        self.code = code
        self.rejection = rejection


@dataclass
class _Flight:
    """One request's progress through the handoff, for its cleanup."""
    manifest: Manifest | None = None
    released: bool = False
    reader_stopped: bool = False      # decode is known not to be pulling (refused, or said so)
    decode_contacted: bool = False
    cached: int = 0


class RouterBackend:
    """The PD cluster as an EngineBackend (server/backend.py) for server/app.py."""

    def __init__(self, prefill_url: str, decode_url: str, secret: bytes, tls: TlsSettings | None = None,
                 model: str | None = None,
                 max_model_len: int | None = None, clamp_context: bool = False, wait_s: float = 300.0,
                 stall_s: float = 10.0, poll_s: float = 1.0):
        self.urls = {"prefill": prefill_url.rstrip("/"), "decode": decode_url.rstrip("/")}
        self._headers = cluster_headers(secret)
        self.tls = tls or TlsSettings()
        # https node URLs are verified against --tls-ca (the system's CAs without it)
        self._verify: ssl.SSLContext | bool = (client_context(self.tls) if any(
            u.startswith("https://") for u in self.urls.values()) else True)
        self._source: TransferSource | None = None   # where decode pulls prefill's holds from
        self.model = model
        self.max_model_len = max_model_len
        self.clamp = clamp_context
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.poll_s = poll_s
        self.tokenizer = None
        self.facts: dict | None = None
        self.snapshot: dict = {}
        self.startup_checks: list[dict] = []
        self.check: ClusterCheck | None = None
        self.error: str | None = None
        self.iterations = 0
        self._ready = False
        self._started = False
        self._stopped = False
        self._boot: dict[str, str] = {}
        self._node_ok: dict[str, bool] = {r: False for r in ROLES}
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()   # aborts already under way (see abort)
        self._background: set[asyncio.Task] = set()
        self._client: httpx.AsyncClient | None = None
        self.ready = threading.Event()

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self._stopped:
            return "stopped"
        if self._ready:
            return "ready"
        return "loading" if self.check is None and self.error is None else "not_ready"

    def start(self) -> RouterBackend:
        """Synchronous start-up: wait for both nodes and run the capacity check (I8).
        Returns with `error` set if the cluster may not serve."""
        if self._started:
            return self
        self._started = True
        self.tokenizer = load_router_tokenizer(self.model)
        deadline = time.monotonic() + self.wait_s
        facts: dict[str, NodeInfo] = {}
        with httpx.Client(timeout=5.0, headers=self._headers, verify=self._verify) as c:
            while len(facts) < len(ROLES):
                for role in ROLES:
                    if role in facts:
                        continue
                    try:
                        r = c.get(self.urls[role] + "/internal/info")
                        if r.status_code == 200:
                            facts[role] = NodeInfo.from_json(r.content)
                            log.info("%s node at %s is up (boot %s)", role, self.urls[role], facts[role].pd.boot_id)
                    except httpx.HTTPError:
                        pass
                    except MessageError as e:
                        self.error = f"the node at {self.urls[role]} sent unusable facts: {e}"
                        return self
                if len(facts) < len(ROLES):
                    if time.monotonic() > deadline:
                        missing = [r for r in ROLES if r not in facts]
                        self.error = f"no answer from the {' and '.join(missing)} node(s) within {self.wait_s:g} s"
                        return self
                    time.sleep(0.5)
        for role, f in facts.items():
            if f.pd.role != role:
                self.error = f"the node at {self.urls[role]} is not a {role} node (it says {f.pd.role})"
                return self
        self._apply_check(facts)
        if self.error is None:  # the monitor has its own thread and event loop; it only swaps attributes
            threading.Thread(target=lambda: asyncio.run(self.run_monitor()), name="kvfence-router-monitor",
                             daemon=True).start()
        return self

    def _apply_check(self, facts: dict[str, NodeInfo]) -> bool:
        # default: what the nodes themselves serve (each checked its own pool at start-up);
        # an explicit --max-model-len is held against every node
        advertised = self.max_model_len or min(f.usable_context for f in facts.values())
        chk = check_cluster(advertised, facts, self.clamp)
        vocab = {f.vocab_size for f in facts.values()}
        if self.tokenizer is not None and len(vocab) == 1 and self.tokenizer.hf.get_vocab_size() > next(iter(vocab)):
            chk.ok = False
            chk.problems.append("the router's tokenizer has more tokens than the nodes' model")
        self.check = chk
        self.startup_checks = [{"name": "cluster capacity", "invariant": "I8",
                                "status": "passed" if chk.ok else "failed", "detail": chk.note}]
        for role, f in facts.items():
            self._boot[role] = f.pd.boot_id
            self._node_ok[role] = True
        self._source = facts["prefill"].source()
        if not chk.ok:
            self.error = f"cluster capacity check failed: {chk.note}"
            self._ready = False
            log.error("%s", self.error)
            return False
        (log.warning if chk.clamped else log.info)("cluster capacity check (I8): %s", chk.note)
        base = facts["decode"].facts()
        base.update(usable_context=chk.usable_context, context_clamped=chk.clamped, context_note=chk.note,
                    pool_tokens=min(f.pool_tokens for f in facts.values()),
                    configured_max_model_len=self.max_model_len, cluster=chk.to_json(),
                    pd_security=self.tls.describe())
        self.facts = base
        self.snapshot = self._merge_snapshots(facts)
        self.error = None
        self._ready = True
        return True

    @staticmethod
    def _merge_snapshots(facts: dict[str, NodeInfo]) -> dict:
        d = dict(facts["decode"].snapshot)
        p = facts["prefill"].snapshot
        d["waiting"] = d.get("waiting", 0) + p.get("waiting", 0)
        d["nodes"] = {role: f.snapshot for role, f in facts.items()}
        return d

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready

    def stop(self, timeout: float = 30.0) -> None:
        self._stopped = True
        self._ready = False

    # -- the monitor (I8 on rejoin) ---------------------------------------------------------------
    async def run_monitor(self) -> None:
        async with httpx.AsyncClient(timeout=2.0, headers=self._headers, verify=self._verify) as c:
            while not self._stopped:
                await asyncio.sleep(self.poll_s)
                facts: dict[str, NodeInfo] = {}
                down: list[str] = []
                for role in ROLES:
                    try:
                        r = await c.get(self.urls[role] + "/internal/info")
                        if r.status_code == 200:
                            facts[role] = NodeInfo.from_json(r.content)
                        else:
                            down.append(f"{role} node is {_error_code(r.content) or r.status_code}")
                    except MessageError as e:
                        down.append(f"{role} node at {self.urls[role]} sent unusable facts ({e})")
                    except httpx.HTTPError as e:
                        down.append(f"{role} node at {self.urls[role]} does not answer ({type(e).__name__})")
                self.iterations += 1
                if down:
                    if self._ready or self.error is None or "does not answer" not in (self.error or ""):
                        log.error("cluster not ready: %s", "; ".join(down))
                    self._ready = False
                    self.error = "; ".join(down)
                    for role in ROLES:
                        self._node_ok[role] = role in facts
                    continue
                rejoined = [r for r in ROLES if facts[r].pd.boot_id != self._boot.get(r)]
                if rejoined or not self._ready:
                    log.info("node(s) %s (re)joined: running the capacity check again", ", ".join(rejoined) or "all")
                    self._apply_check(facts)
                else:
                    self.snapshot = self._merge_snapshots(facts)

    # -- requests -----------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.stall_s, connect=5.0), verify=self._verify,
                                             headers=self._headers,
                                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        return self._client

    async def submit(self, prompt_ids: list[int], params: SamplingParams, tenant: str,
                     request_id: str | None = None, public_prefix_scope: str | None = None) -> RequestHandle:
        if not self._ready or self.facts is None:
            raise EngineFailed(self.error or f"the cluster is {self.state}")
        usable = self.facts["usable_context"]
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, usable - len(prompt_ids))
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        rid = request_id or f"pd-{time.time_ns()}"
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future = loop.create_future()
        handle = RequestHandle(rid, asyncio.Queue())
        task = asyncio.create_task(self._run(rid, list(prompt_ids), params, tenant, public_prefix_scope, handle,
                                             admitted))
        self._tasks[rid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(rid, None))
        try:
            await admitted
        except BaseException:
            task.cancel()
            raise
        handle.admitted = Admitted(rid, len(prompt_ids), max_tokens)
        return handle

    def abort(self, request_id: str, reason: str = "client disconnected") -> None:
        """Idempotent: a second cancel would interrupt the first one's cleanup (closing the
        node streams, which is what aborts the request on the nodes)."""
        task = self._tasks.get(request_id)
        if task is not None and not task.done() and request_id not in self._cancelled:
            self._cancelled.add(request_id)
            task.add_done_callback(lambda _t: self._cancelled.discard(request_id))
            task.cancel()

    def _later(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _post(self, role: str, path: str, body: WireModel) -> None:
        try:
            await self._http().post(self.urls[role] + path, **_json(body))
        except httpx.HTTPError as e:
            log.warning("%s %s failed: %s", role, path, e)

    async def _run(self, rid: str, ids: list[int], params: SamplingParams, tenant: str, scope: str | None,
                   handle: RequestHandle, admitted: asyncio.Future) -> None:
        wire = WireParams.of(params)
        flight = _Flight()

        def fail(message: str, code: str, rejection: RejectedEvent | None = None) -> None:
            if not admitted.done():
                admitted.set_exception(_as_submit_error(message, code, rejection))
                return
            handle.updates.put_nowait(Update((), "", True, "aborted", message, len(ids), 0, flight.cached,
                                             abort_code=code))

        try:
            if len(ids) >= 2:
                await self._prefill(PrefillBody(request_id=rid, tenant=tenant, prompt_ids=ids, params=wire,
                                                public_prefix_scope=scope), flight)
                if flight.manifest is None:
                    return
                if faults.active("delay_handoff"):
                    await asyncio.sleep(faults.arg_float("delay_handoff", 1.0))
            handoff = None
            if flight.manifest is not None:
                source = self._source
                if source is None or source.boot_id != flight.manifest.boot_id:
                    raise NodeError("the prefill node restarted after holding the KV", "node_failed")
                handoff = Handoff(manifest=flight.manifest, source=source)
            body = DecodeBody(request_id=rid, tenant=tenant, prompt_ids=ids, params=wire,
                              public_prefix_scope=scope, handoff=handoff)
            await self._decode(body, flight, handle, admitted, len(ids))
        except asyncio.CancelledError:
            raise
        except NodeError as e:
            fail(str(e), e.code, e.rejection)
        except Exception as e:  # noqa: BLE001 - whatever a node did, this request fails with a code
            fail(f"a PD node failed mid-request: {type(e).__name__}: {e}", "node_failed")
        finally:
            if flight.manifest is not None and not flight.released:
                self._later(self._settle_prefill(rid, flight))

    async def _settle_prefill(self, rid: str, flight: _Flight) -> None:
        """Tell prefill the request is over, and whether a pull of its rows can still run: if
        decode was contacted and did not say, ask it (it ends the request and answers), so
        rows decode never began to read are freed at once instead of fenced (I6)."""
        stopped = flight.reader_stopped or not flight.decode_contacted
        if not stopped:
            try:
                r = await self._http().post(self.urls["decode"] + "/internal/stop_pull",
                                            **_json(StopPullBody(request_id=rid)))
                stopped = r.status_code == 200 and StopPullReply.from_json(r.content).reader_stopped
            except (httpx.HTTPError, MessageError) as e:
                log.warning("decode did not say whether it still reads %s (%s): prefill fences its rows", rid, e)
        await self._post("prefill", "/internal/abort", AbortBody(
            request_id=rid, reader_stopped=stopped, reason="the request ended before decode verified the transfer"))

    async def _events(self, role: str, response: httpx.Response) -> AsyncIterator[Any]:
        """The node's NDJSON events, checked against their definitions; heartbeats dropped."""
        async for text in response.aiter_lines():
            if not text.strip():
                continue
            try:
                ev = parse_event(text)
            except MessageError as e:
                raise NodeError(f"the {role} node sent {e}", "node_error") from None
            if not isinstance(ev, WaitEvent):
                yield ev

    async def _open(self, role: str, path: str, body: WireModel, stack: AsyncExitStack) -> httpx.Response:
        try:
            r = await stack.enter_async_context(self._http().stream("POST", self.urls[role] + path, **_json(body)))
        except httpx.HTTPError as e:
            raise NodeError(f"the {role} node is unreachable: {type(e).__name__}: {e}", "node_unavailable") from None
        if r.status_code != 200:
            raw = await r.aread()
            err = _error_of(raw)
            if err is None:
                raise NodeError(f"{role} node answered {r.status_code}", "node_error")
            raise NodeError(f"{role} node: {err[0]}", err[1] or "node_error")
        return r

    async def _admitted(self, role: str, events: AsyncIterator[Any]) -> AdmittedEvent:
        first = await anext(events, None)
        if isinstance(first, RejectedEvent):
            raise NodeError(f"{role} node: {first.message}", first.code, first)
        if not isinstance(first, AdmittedEvent):
            what = "nothing" if first is None else first.event
            raise NodeError(f"{role} node: expected admitted, got {what}", "node_error")
        return first

    async def _prefill(self, body: PrefillBody, flight: _Flight) -> None:
        async with AsyncExitStack() as stack:
            events = self._events("prefill", await self._open("prefill", "/internal/prefill", body, stack))
            await self._admitted("prefill", events)
            async for ev in events:
                if isinstance(ev, ProgressEvent) and ev.event == "kv_held" and ev.manifest is not None:
                    flight.manifest = ev.manifest
                    flight.cached = ev.cached_tokens
                    if faults.active("kill_node_at") and faults.arg("kill_node_at") == "router_after_prefill":
                        os._exit(137)
                    return
                if isinstance(ev, (ProgressEvent, FailedEvent)) and ev.finished:
                    raise NodeError(f"prefill failed: {ev.error or getattr(ev, 'finish_reason', None)}",
                                    ev.abort_code or "prefill_failed")
            raise NodeError("the prefill node closed the stream before holding the KV", "node_failed")

    async def _decode(self, body: DecodeBody, flight: _Flight, handle: RequestHandle, admitted: asyncio.Future,
                      n_prompt: int) -> None:
        async with AsyncExitStack() as stack:
            flight.decode_contacted = True
            try:
                events = self._events("decode", await self._open("decode", "/internal/decode", body, stack))
                await self._admitted("decode", events)
            except NodeError as e:
                if e.code != "node_unavailable":  # decode answered and refused: it never pulls
                    flight.reader_stopped = True
                raise
            if not admitted.done():
                admitted.set_result(True)
            first_at = None
            async for ev in events:
                if isinstance(ev, FailedEvent):
                    raise NodeError(f"decode node: {ev.error}", ev.abort_code)
                if not isinstance(ev, ProgressEvent):
                    raise NodeError(f"decode node: unexpected {ev.event} event", "node_error")
                if ev.event == "kv_verified":
                    flight.released = True
                    self._later(self._post("prefill", "/internal/release", ReleaseBody(request_id=body.request_id)))
                    continue
                if ev.event == "kv_failed":
                    flight.reader_stopped = bool(ev.reader_stopped)
                now = time.perf_counter()
                toks = tuple(ev.token_ids)
                if toks and first_at is None:
                    first_at = now
                completion = ev.completion_tokens
                lps = tuple(Logprob(lp.token_id, lp.logprob, tuple(lp.top)) for lp in ev.logprobs)
                handle.updates.put_nowait(Update(
                    toks, ev.text, ev.finished, ev.finish_reason, ev.error, n_prompt, completion, flight.cached, lps,
                    first_at, (now,) * len(toks), ev.abort_code))
                if ev.finished:
                    return
            raise NodeError("the decode node closed the stream mid-request", "node_failed")


def _json(body: WireModel) -> dict[str, Any]:
    """An internal message as an httpx request's body."""
    return {"content": body.dumps(), "headers": {"content-type": "application/json"}}


def _error_of(raw: bytes) -> tuple[str, str | None] | None:
    """(message, code) of an error body in OpenAI's shape, or None."""
    try:
        err = json.loads(raw)["error"]
        return str(err["message"]), (str(err["code"]) if err.get("code") is not None else None)
    except (ValueError, KeyError, TypeError):
        return None


def _error_code(raw: bytes) -> str | None:
    err = _error_of(raw)
    return None if err is None else err[1]


def _as_submit_error(message: str, code: str, rejection: RejectedEvent | None) -> Exception:
    """What submit() raises before the request is admitted, in the shapes app.py maps to HTTP.
    A node's context-length refusal arrives with its numbers as fields."""
    r = rejection
    if code == "context_length_exceeded" and r is not None and None not in (r.limit, r.prompt_tokens, r.max_tokens):
        return ContextLengthExceeded(r.prompt_tokens, r.max_tokens, r.limit)  # type: ignore[arg-type]
    if code in ("invalid_request", "context_length_exceeded"):
        return ValueError(message)
    return EngineFailed(message, code)


def serve_router(prefill_url: str, decode_url: str, model: str | None, host: str, port: int,
                 max_model_len: int | None, clamp_context: bool, secret: bytes, tls: TlsSettings,
                 tenants_file: str | None = None,
                 served_model_name: str | None = None, log_level: str = "info", wait_s: float = 300.0,
                 stall_s: float = 10.0, limits: HttpLimits | None = None) -> int:
    from kvfence.server import fault_control
    from kvfence.server.app import ServerState, create_app
    from kvfence.server.serve import load_tenants

    tenants = load_tenants(tenants_file)
    backend = RouterBackend(prefill_url, decode_url, secret, tls, model, max_model_len, clamp_context, wait_s,
                            stall_s).start()
    if backend.error is not None:
        log.error("router not serving: %s", backend.error)
        return 2
    state = ServerState(backend, tenants, served_model_name)
    app = create_app(state)
    faults.announce(log)
    fault_control.mount(app)

    @app.get("/v1/kvfence/cluster")
    async def cluster():
        return {"ready": backend.state == "ready", "error": backend.error,
                "check": backend.check.to_json() if backend.check else None,
                "nodes": {r: {"url": backend.urls[r], "answering": backend._node_ok[r], "boot_id": backend._boot.get(r)}
                          for r in ROLES}}

    log.info("router serving model %r on http://%s:%d/v1 (prefill %s, decode %s)", state.served_name, host, port,
             prefill_url, decode_url)
    uvicorn_server(app, host, port, limits or HttpLimits(), log_level,
                   **uvicorn_options(tls, client_certificates=False)).run()
    return 0
