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
import json
import logging
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded
from kvfence.engine.params import SamplingParams
from kvfence.pd.capacity import ClusterCheck, check_cluster
from kvfence.pd.wire import cluster_headers, params_to_json
from kvfence.server.engine_loop import Admitted, EngineFailed, Logprob, RequestHandle, Update

log = logging.getLogger("kvfence.pd.router")

ROLES = ("prefill", "decode")


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
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class RouterBackend:
    """Duck-types server.engine_loop.EngineLoop for server/app.py."""

    def __init__(self, prefill_url: str, decode_url: str, model: str | None = None,
                 max_model_len: int | None = None, clamp_context: bool = False, wait_s: float = 300.0,
                 stall_s: float = 10.0, poll_s: float = 1.0):
        self.urls = {"prefill": prefill_url.rstrip("/"), "decode": decode_url.rstrip("/")}
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

    def start(self) -> "RouterBackend":
        """Synchronous start-up: wait for both nodes and run the capacity check (I8).
        Returns with `error` set if the cluster may not serve."""
        if self._started:
            return self
        self._started = True
        self.tokenizer = load_router_tokenizer(self.model)
        deadline = time.monotonic() + self.wait_s
        facts: dict[str, dict] = {}
        with httpx.Client(timeout=5.0, headers=cluster_headers()) as c:
            while len(facts) < len(ROLES):
                for role in ROLES:
                    if role in facts:
                        continue
                    try:
                        r = c.get(self.urls[role] + "/internal/info")
                        if r.status_code == 200:
                            facts[role] = r.json()
                            log.info("%s node at %s is up (boot %s)", role, self.urls[role],
                                     facts[role].get("pd", {}).get("boot_id"))
                    except httpx.HTTPError:
                        pass
                if len(facts) < len(ROLES):
                    if time.monotonic() > deadline:
                        missing = [r for r in ROLES if r not in facts]
                        self.error = f"no answer from the {' and '.join(missing)} node(s) within {self.wait_s:g} s"
                        return self
                    time.sleep(0.5)
        for role, f in facts.items():
            if f.get("pd", {}).get("role") != role:
                self.error = f"the node at {self.urls[role]} is not a {role} node (it says {f.get('pd', {}).get('role')})"
                return self
        self._apply_check(facts)
        if self.error is None:  # the monitor has its own thread and event loop; it only swaps attributes
            threading.Thread(target=lambda: asyncio.run(self.run_monitor()), name="kvfence-router-monitor",
                             daemon=True).start()
        return self

    def _apply_check(self, facts: dict[str, dict]) -> bool:
        # default: what the nodes themselves serve (each checked its own pool at start-up);
        # an explicit --max-model-len is held against every node
        advertised = self.max_model_len or min(int(f["usable_context"]) for f in facts.values())
        chk = check_cluster(advertised, facts, self.clamp)
        vocab = {f.get("vocab_size") for f in facts.values()}
        if self.tokenizer is not None and len(vocab) == 1 and self.tokenizer.hf.get_vocab_size() > next(iter(vocab)):
            chk.ok = False
            chk.problems.append("the router's tokenizer has more tokens than the nodes' model")
        self.check = chk
        self.startup_checks = [{"name": "cluster capacity", "invariant": "I8",
                                "status": "passed" if chk.ok else "failed", "detail": chk.note}]
        for role, f in facts.items():
            self._boot[role] = f.get("pd", {}).get("boot_id")
            self._node_ok[role] = True
        if not chk.ok:
            self.error = f"cluster capacity check failed: {chk.note}"
            self._ready = False
            log.error("%s", self.error)
            return False
        (log.warning if chk.clamped else log.info)("cluster capacity check (I8): %s", chk.note)
        base = dict(facts["decode"])
        base.pop("snapshot", None)
        base.update(usable_context=chk.usable_context, context_clamped=chk.clamped, context_note=chk.note,
                    pool_tokens=min(int(f["pool_tokens"]) for f in facts.values()),
                    configured_max_model_len=self.max_model_len, cluster=chk.to_json())
        self.facts = base
        self.snapshot = self._merge_snapshots(facts)
        self.error = None
        self._ready = True
        return True

    @staticmethod
    def _merge_snapshots(facts: dict[str, dict]) -> dict:
        d = dict(facts["decode"].get("snapshot") or {})
        p = facts["prefill"].get("snapshot") or {}
        d["waiting"] = d.get("waiting", 0) + p.get("waiting", 0)
        d["nodes"] = {role: f.get("snapshot") for role, f in facts.items()}
        return d

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready

    def stop(self, timeout: float = 30.0) -> None:
        self._stopped = True
        self._ready = False

    # -- the monitor (I8 on rejoin) ---------------------------------------------------------------
    async def run_monitor(self) -> None:
        async with httpx.AsyncClient(timeout=2.0, headers=cluster_headers()) as c:
            while not self._stopped:
                await asyncio.sleep(self.poll_s)
                facts, down = {}, []
                for role in ROLES:
                    try:
                        r = await c.get(self.urls[role] + "/internal/info")
                        if r.status_code == 200:
                            facts[role] = r.json()
                        else:
                            down.append(f"{role} node is {r.json().get('error', {}).get('code', r.status_code)}")
                    except (httpx.HTTPError, ValueError) as e:
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
                rejoined = [r for r in ROLES if facts[r].get("pd", {}).get("boot_id") != self._boot.get(r)]
                if rejoined or not self._ready:
                    log.info("node(s) %s (re)joined: running the capacity check again", ", ".join(rejoined) or "all")
                    self._apply_check(facts)
                else:
                    self.snapshot = self._merge_snapshots(facts)

    # -- requests -----------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.stall_s, connect=5.0),
                                             headers=cluster_headers(),
                                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        return self._client

    async def submit(self, prompt_ids: list[int], params: SamplingParams, tenant: str,
                     request_id: str | None = None, public_prefix_scope: str | None = None) -> RequestHandle:
        if not self._ready:
            raise EngineFailed(self.error or f"the cluster is {self.state}")
        usable = self.facts["usable_context"]
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, usable - len(prompt_ids))
        if max_tokens != params.max_tokens:
            params = SamplingParams(**{**params_to_json(params), "max_tokens": max_tokens})
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
        if task is not None and not task.done() and not getattr(task, "kvfence_cancelled", False):
            task.kvfence_cancelled = True
            task.cancel()

    def _later(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _post(self, role: str, path: str, body: dict) -> None:
        try:
            await self._http().post(self.urls[role] + path, json=body)
        except httpx.HTTPError as e:
            log.warning("%s %s failed: %s", role, path, e)

    async def _run(self, rid, ids, params, tenant, scope, handle: RequestHandle, admitted: asyncio.Future) -> None:
        body = {"request_id": rid, "tenant": tenant, "prompt_ids": ids, "params": params_to_json(params),
                "public_prefix_scope": scope}
        # reader_stopped: decode is known not to be pulling (never contacted, refused, or said so)
        state = {"manifest": None, "released": False, "reader_stopped": False, "decode_contacted": False,
                 "cached": 0}

        def fail(message: str, code: str) -> None:
            if not admitted.done():
                admitted.set_exception(_as_submit_error(message, code, len(ids), params.max_tokens))
                return
            handle.updates.put_nowait(Update((), "", True, "aborted", message, len(ids), 0, state["cached"],
                                             abort_code=code))

        try:
            if len(ids) >= 2:
                await self._prefill(body, state)
                if state["manifest"] is None:
                    return
                if faults.active("delay_handoff"):
                    await asyncio.sleep(faults.arg_float("delay_handoff", 1.0))
            await self._decode(body, state, handle, admitted, len(ids))
        except asyncio.CancelledError:
            raise
        except NodeError as e:
            fail(str(e), e.code)
        except (httpx.HTTPError, ValueError, KeyError, StopAsyncIteration) as e:
            fail(f"a PD node failed mid-request: {type(e).__name__}: {e}", "node_failed")
        finally:
            if state["manifest"] is not None and not state["released"]:
                stopped = state["reader_stopped"] or not state["decode_contacted"]
                self._later(self._post("prefill", "/internal/abort",
                                       {"request_id": rid, "reader_stopped": stopped,
                                        "reason": "the request ended before decode verified the transfer"}))

    async def _lines(self, response: httpx.Response):
        it = response.aiter_lines()
        while True:
            try:
                text = await it.__anext__()
            except StopAsyncIteration:
                return
            if text.strip():
                ev = json.loads(text)
                if ev.get("event") != "wait":
                    yield ev

    async def _open(self, role: str, path: str, body: dict, stack) -> httpx.Response:
        try:
            r = await stack.enter_async_context(self._http().stream("POST", self.urls[role] + path, json=body))
        except httpx.HTTPError as e:
            raise NodeError(f"the {role} node is unreachable: {type(e).__name__}: {e}", "node_unavailable") from None
        if r.status_code != 200:
            raw = await r.aread()
            try:
                err = json.loads(raw)["error"]
                raise NodeError(f"{role} node: {err['message']}", err.get("code") or "node_error")
            except (ValueError, KeyError, TypeError):
                raise NodeError(f"{role} node answered {r.status_code}", "node_error") from None
        return r

    @staticmethod
    def _check_admitted(role: str, first: dict) -> None:
        if first.get("event") == "rejected":
            raise NodeError(f"{role} node: {first.get('message')}", first.get("code") or "node_error")
        if first.get("event") != "admitted":
            raise NodeError(f"{role} node: unexpected {first.get('event')}", "node_error")

    async def _prefill(self, body, state) -> None:
        async with AsyncExitStack() as stack:
            r = await self._open("prefill", "/internal/prefill", body, stack)
            events = self._lines(r)
            self._check_admitted("prefill", await events.__anext__())
            async for ev in events:
                if ev.get("event") == "kv_held":
                    state["manifest"] = ev["data"]
                    state["cached"] = ev.get("cached_tokens", 0)
                    if faults.active("kill_node_at") and faults.arg("kill_node_at") == "router_after_prefill":
                        import os
                        os._exit(137)
                    return
                if ev.get("finished"):
                    raise NodeError(f"prefill failed: {ev.get('error') or ev.get('finish_reason')}",
                                    ev.get("abort_code") or "prefill_failed")
            raise NodeError("the prefill node closed the stream before holding the KV", "node_failed")

    async def _decode(self, body, state, handle: RequestHandle, admitted, n_prompt: int) -> None:
        async with AsyncExitStack() as stack:
            state["decode_contacted"] = True
            try:
                r = await self._open("decode", "/internal/decode", {**body, "manifest": state["manifest"]}, stack)
                events = self._lines(r)
                self._check_admitted("decode", await events.__anext__())
            except NodeError as e:
                if e.code != "node_unavailable":  # decode answered and refused: it never pulls
                    state["reader_stopped"] = True
                raise
            if not admitted.done():
                admitted.set_result(True)
            first_at, completion = None, 0
            async for ev in events:
                kind = ev.get("event")
                if kind == "kv_verified":
                    state["released"] = True
                    self._later(self._post("prefill", "/internal/release", {"request_id": body["request_id"]}))
                    continue
                if kind == "kv_failed":
                    state["reader_stopped"] = bool((ev.get("data") or {}).get("reader_stopped"))
                now = time.perf_counter()
                toks = tuple(ev.get("token_ids") or ())
                if toks and first_at is None:
                    first_at = now
                completion = ev.get("completion_tokens", completion)
                lps = tuple(Logprob(int(t), float(v), tuple((int(a), float(b)) for a, b in top))
                            for t, v, top in ev.get("logprobs") or ())
                handle.updates.put_nowait(Update(
                    toks, ev.get("text") or "", bool(ev.get("finished")), ev.get("finish_reason"), ev.get("error"),
                    n_prompt, completion, state["cached"], lps, first_at, (now,) * len(toks), ev.get("abort_code")))
                if ev.get("finished"):
                    return
            raise NodeError("the decode node closed the stream mid-request", "node_failed")


def _as_submit_error(message: str, code: str, prompt_tokens: int, max_tokens: int) -> Exception:
    """What submit() raises before the request is admitted, in the shapes app.py maps to HTTP."""
    if code == "context_length_exceeded":
        import re
        m = re.search(r"maximum context length is (\d+)", message)
        if m:
            return ContextLengthExceeded(prompt_tokens, max_tokens, int(m.group(1)))
        return ValueError(message)
    if code == "invalid_request":
        return ValueError(message)
    e = EngineFailed(message)
    e.code = code
    return e


def serve_router(prefill_url: str, decode_url: str, model: str | None, host: str, port: int,
                 max_model_len: int | None, clamp_context: bool, tenants_file: str | None = None,
                 served_model_name: str | None = None, log_level: str = "info", wait_s: float = 300.0,
                 stall_s: float = 10.0) -> int:
    import uvicorn

    from kvfence.server import fault_control
    from kvfence.server.app import ServerState, create_app
    from kvfence.server.serve import load_tenants

    tenants = load_tenants(tenants_file)
    backend = RouterBackend(prefill_url, decode_url, model, max_model_len, clamp_context, wait_s, stall_s).start()
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
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    return 0
