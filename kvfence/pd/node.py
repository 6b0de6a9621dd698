"""A PD node process: `kvfence serve --role prefill|decode`.

The node is a normal kvfence server (same engine thread, /health, /metrics, isolation
statement) whose engine has a KV link attached, plus the internal routes the router uses:

  GET  /internal/info      what the router's capacity check (I8) needs, and the boot id
  POST /internal/prefill   prefill: admit, compute, hold; NDJSON: admitted, then kv_held | failed
  POST /internal/release   prefill: decode verified the transfer (the ACK)
  POST /internal/abort     prefill: end a request; reader_stopped says no pull can be running
  POST /internal/decode    decode: admit, reserve, pull, verify, generate; NDJSON updates
  POST /internal/drain     take no new request, finish, exit 0 (also on SIGTERM; pd/drain.py)

A router that disconnects from a prefill or decode stream aborts that request on the node.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar, cast

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded, Overloaded
from kvfence.engine.config import EngineConfig
from kvfence.engine.grammar import build_matcher, ll_tokenizer
from kvfence.engine.router_realms import RouterRealms
from kvfence.pd.drain import DEFAULT_LIMIT_S, Drain
from kvfence.pd.manifest import ManifestError
from kvfence.pd.messages import (
    AbortBody,
    AdmittedEvent,
    ControlReply,
    DecodeBody,
    FailedEvent,
    ForgetTenantsBody,
    ForgetTenantsReply,
    LogprobEntry,
    Manifest,
    MessageError,
    NodeInfo,
    PrefillBody,
    ProgressEvent,
    RejectedEvent,
    ReleaseBody,
    StopPullBody,
    StopPullReply,
    WaitEvent,
    WireModel,
    event_line,
)
from kvfence.pd.scope_epochs import Outcome, ScopeGate, ScopeRetired
from kvfence.pd.seal import CONTROL_HEADER, describe_secrets
from kvfence.pd.settings import PDSettings
from kvfence.pd.tls import TlsSettings, uvicorn_options
from kvfence.server.backend import EngineFailed, Update
from kvfence.server.disconnect import watch_disconnect
from kvfence.server.engine_loop import EngineLoop, Retirement
from kvfence.server.errors import APIError, error_body
from kvfence.server.http_limits import HttpLimits, address_group, uvicorn_server
from kvfence.server.log_budget import LogBudget
from kvfence.server.protocol import read_body_bytes
from kvfence.server.streaming import StreamWithCleanup

if TYPE_CHECKING:
    from kvfence.server.app import ServerState
    from kvfence.server.tenants import TenantRegistry

log = logging.getLogger("kvfence.pd.node")

# decode builds schemas' matchers here, one at a time: not on the engine thread, and not in the
# default pool that body parsing shares (the router's check bounds each build: server/app.py)
_GRAMMAR_BUILDS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfence-grammar")

HEARTBEAT_S = 1.0
# the largest internal body: a prompt of MAX_PROMPT_IDS ids with its manifest fits
MAX_INTERNAL_BODY_BYTES = 16 << 20


def unchecked_boot(expected: str | None, boot: str | None) -> str | None:
    """Why a request the router addressed to boot `expected` may not run on this process
    (boot `boot`), or None: a restarted node serves only once the router checked it (I8)."""
    if expected is None or expected == boot or faults.active("skip_boot_check"):
        return None
    return (f"this node is boot {boot}, the router checked boot {expected}: it takes requests once the router has "
            f"checked it again")


def build_node_engine(config: EngineConfig, settings: PDSettings, loaded=None):
    """Runs in the engine thread: the engine, then its KV link on a Mooncake transport."""
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.pd.decode import KvImporter
    from kvfence.pd.prefill import KvExporter
    from kvfence.pd.transfer import PageTransport

    engine = LLMEngine(config, loaded)
    engine.realms = RouterRealms(settings.router_scope_idle_s)
    transport = PageTransport(settings.transfer_host, settings.transfer_timeout_s)
    link = (KvExporter if settings.role == "prefill" else KvImporter)(engine, settings, transport)
    log.info("%s node: transfer engine %s, transfer buffer %d rows x %d bytes; lease %.0f s, fence after "
             "deadline + %.0f s", settings.role, transport.session_id, link.staging.capacity_pages,
             link.staging.slot_bytes, settings.lease_s, settings.max_pull_s + settings.clock_skew_s)
    log.info("%s node: %s", settings.role, describe_secrets(settings.secrets))
    return engine


INTERNAL_PREFIX = "/internal"   # every route under it takes only the cluster credential (I11)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code),
                        status_code=status)


M = TypeVar("M", bound=WireModel)


async def _read(request: Request, cls: type[M]) -> M:
    """The body as message `cls`, or an APIError (413 over the limit, 400 naming the bad
    fields): nothing is admitted for a malformed message. Large bodies (long prompts) are
    parsed in a worker thread so the event loop keeps serving every other stream."""
    raw = await read_body_bytes(request, MAX_INTERNAL_BODY_BYTES)
    try:
        if len(raw) > 64 << 10:
            return await asyncio.to_thread(cls.from_json, raw)
        return cls.from_json(raw)
    except MessageError as e:
        raise APIError(400, f"bad internal request: {e}", code="invalid_request") from None


def _refusal(e: Exception) -> RejectedEvent:
    if isinstance(e, ContextLengthExceeded):
        return RejectedEvent(code="context_length_exceeded", message=str(e), limit=e.limit,
                             prompt_tokens=e.prompt_tokens, max_tokens=e.max_tokens)
    if isinstance(e, ManifestError):
        return RejectedEvent(code="kv_manifest_invalid", message=f"refused the KV handoff: {e}"[:4096])
    if isinstance(e, EngineFailed):
        return RejectedEvent(code="engine_unavailable", message=str(e)[:4096])
    if isinstance(e, Overloaded):
        return RejectedEvent(code="server_overloaded", message=str(e)[:4096])
    if isinstance(e, ScopeRetired):
        return RejectedEvent(code="scope_retired", message=str(e)[:4096])
    return RejectedEvent(code="invalid_request", message=f"bad internal request: {e}"[:4096])


def _progress(u: Update) -> ProgressEvent:
    data = u.data or {}
    return ProgressEvent(
        event=u.event or ("finished" if u.finished else "tokens"),  # type: ignore[arg-type]
        token_ids=list(u.token_ids), text=u.text, finished=u.finished, finish_reason=u.finish_reason,
        error=u.error, abort_code=u.abort_code, prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
        logprobs=[LogprobEntry(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top)) for lp in u.logprobs],
        manifest=Manifest.from_json(data) if u.event == "kv_held" else None,
        verified_tokens=data.get("tokens") if u.event == "kv_verified" else None,
        reader_stopped=data.get("reader_stopped") if u.event == "kv_failed" else None,
        started_ago_s=(min(86400.0, max(0.0, time.perf_counter() - u.started_at))
                       if u.event == "kv_held" and u.started_at is not None else None))


def add_internal_routes(app: FastAPI, loop: EngineLoop, settings: PDSettings, drain: Drain,
                        on_refused: Callable[[], None] | None = None) -> APIRouter:
    """on_refused: told of each call refused for its credential (the node's metric)."""
    refusals_logged = LogBudget(per_window=5, window_s=60.0, max_keys=256)

    async def _cluster_only(request: Request) -> None:   # async: no worker-thread hop a request
        # I11, declared on the routes themselves: a middleware matching request.url.path let
        # through what a Host header made look like another path (Starlette before 1.0.1
        # built url.path from it while routing used the scope's path)
        if not settings.secrets.accepts(request.headers.get(CONTROL_HEADER)):   # as of now (SIGHUP reloads)
            if on_refused is not None:
                on_refused()
            # who reached the PD plane without the secret: a prober, or a process on a stale
            # secret; a few lines a minute per address (a loop of them must not fill the log)
            peer = request.client.host if request.client is not None else "?"
            # by address group: an IPv6 host has a /64 to rotate through (as http_limits counts)
            left_out = refusals_logged.take(address_group(peer))
            if left_out is not None:   # the path as repr: it is the caller's, control characters too
                log.warning("internal route refused: %s %r from %s without a valid cluster credential%s",
                            request.method[:16], request.url.path[:100], peer,
                            f" ({left_out} more from it not logged)" if left_out else "")
            raise APIError(401, "internal API: missing or wrong cluster credential", code="unauthorized")

    internal = APIRouter(prefix=INTERNAL_PREFIX, dependencies=[Depends(_cluster_only)])

    @app.exception_handler(EngineFailed)
    async def _engine_failed(request: Request, e: EngineFailed):
        # a control message to a node whose engine stopped: the router takes 503 for "not serving"
        return _error(503, f"the node's engine is not serving: {e}"[:4096], "engine_unavailable")

    @internal.get("/info")
    async def info():
        if loop.state != "ready" or loop.facts is None:
            return _error(503, f"node is {loop.state}: {loop.error or ''}", "not_ready")
        return NodeInfo.from_json({**loop.facts, "scope_stamps": True, "seal_keys": True, "choice_groups": True,
                                   "secret_key_ids": settings.secrets.key_ids,
                                   "snapshot": {**loop.snapshot, "draining": drain.active}}).to_json()

    @internal.post("/drain")
    async def start_drain():
        started = drain.start("the router or an operator asked (POST /internal/drain)")
        return ControlReply(result="draining" if started else "already_draining").to_json()

    # which generation of each tenant's scope each router retired here, and the retirements queued
    scopes = ScopeGate(lambda tenants, router: loop.retire_soon(tenants, router))

    @internal.post("/forget_tenants")
    async def forget_tenants(request: Request):
        # both roles: prefill's cached prefixes, and on either the grammars kept under the scope
        body = await _read(request, ForgetTenantsBody)
        retiring: Outcome | None
        if body.router is None or body.epoch is None:   # a router from before scope stamps
            retiring = scopes.forget_unstamped(list(body.tenants))
        else:
            retiring = scopes.forget(body.router, body.epoch, list(body.tenants))
        if retiring is None:
            return ForgetTenantsReply(pages=0).to_json()
        # shielded: a router hanging up cancels this wait, not the queued retirement, which
        # still runs (and, should it fail, marks its pairs to retire again: ScopeGate)
        return ForgetTenantsReply(pages=await asyncio.shield(cast(Retirement, retiring).future)).to_json()

    def _refuse_if_draining() -> None:
        if drain.active:
            raise APIError(503, "node is draining: it takes no new request", code="draining")

    def _refuse_if_unchecked(body: PrefillBody) -> None:
        why = unchecked_boot(body.expect_boot, (loop.facts or {}).get("pd", {}).get("boot_id"))
        if why:
            raise APIError(503, why, code="not_ready")

    def _params(body: PrefillBody):
        try:   # WireParams bounds every field already; SamplingParams' own checks are the last word
            return body.params.to_params()
        except ValueError as e:
            raise APIError(400, f"bad internal request: params: {e}", code="invalid_request") from None

    def _stream(body: PrefillBody, request: Request, **extra) -> StreamWithCleanup:
        """Answer at once and admit inside the stream: the router then hears a heartbeat
        every second from the start, so a node busy with a long step is not taken for a
        hung one. First line: admitted or rejected; then updates; the router hanging up
        aborts the request here."""
        rid = body.request_id
        params = _params(body)
        drain.streams += 1

        async def admit():
            if params.json_schema is not None and not extra.get("hold_kv"):   # decode samples, prefill not
                # built here, in a thread: on the engine's thread it would stop every request's
                # steps for as long as it takes (the router's check bounds that: app.py)
                vocab, schema = (loop.facts or {}).get("vocab_size"), str(params.json_schema)
                extra["grammar"] = await asyncio.get_running_loop().run_in_executor(
                    _GRAMMAR_BUILDS, lambda: build_matcher(ll_tokenizer(loop.tokenizer, vocab), schema))
            # one event-loop step from the scope check to the submission's command: no forget
            # message or other request can retire the scope in between (pd/scope_epochs.py)
            router = body.scope.router if body.scope is not None else None
            # its own retirement or an earlier one: the engine runs it first and, should it have
            # failed, refuses the request before admitting it (ScopeNotRetired: the scope still
            # holds the old party's prompts)
            behind = cast(Retirement | None, scopes.admit(body.scope, body.tenant))
            # the cache scope is the stamping router's (ledger.scope_name): a name another router
            # (or this one restarted) gave to another party shares no page with it
            return await loop.submit(body.prompt_ids, params, body.tenant, rid, body.public_prefix_scope,
                                     router=router, behind=behind, **extra)

        async def gen():
            sub = asyncio.ensure_future(admit())
            # watch for the router hanging up explicitly (writes to a closed connection do not
            # fail reliably)
            watcher = asyncio.create_task(watch_disconnect(request, lambda: loop.abort(rid, "router disconnected")))
            handle = None
            try:
                while not sub.done():
                    done, _ = await asyncio.wait({sub}, timeout=HEARTBEAT_S)
                    if not done:
                        yield event_line(WaitEvent())
                try:
                    handle = sub.result()
                except (ContextLengthExceeded, ManifestError, EngineFailed, Overloaded, ScopeRetired, ValueError) as e:
                    yield event_line(_refusal(e))
                    return
                a = handle.admission
                yield event_line(AdmittedEvent(prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens))
                while not handle.done:
                    try:  # a heartbeat each second: the router tells a slow node from a hung one
                        u = await asyncio.wait_for(handle.next(), HEARTBEAT_S)
                    except TimeoutError:
                        yield event_line(WaitEvent())
                        continue
                    yield event_line(_progress(u))
            except EngineFailed as e:
                yield event_line(FailedEvent(error=str(e)[:4096]))
            finally:
                watcher.cancel()
                if handle is None and not sub.done():
                    sub.cancel()  # still waiting for admission: EngineLoop.submit aborts it
                elif handle is None or not handle.done:  # the router went away: abort it here too
                    # (handle None with sub done: admitted just as the router left, nobody reads it)
                    loop.abort(rid, "router disconnected")
        # counted down when the response is done, even if its body never started (the router
        # hung up first): a count left up held every later drain for its whole limit
        return StreamWithCleanup(gen(), drain.stream_ended, "application/x-ndjson")

    if settings.role == "prefill":
        @internal.post("/prefill")
        async def prefill(request: Request):
            _refuse_if_draining()
            body = await _read(request, PrefillBody)
            _refuse_if_unchecked(body)
            return _stream(body, request, hold_kv=True)

        @internal.post("/release")
        async def release(request: Request):
            rid = (await _read(request, ReleaseBody)).request_id
            return ControlReply(result=await loop.call(lambda e: e.release_kv(rid))).to_json()

        @internal.post("/abort")
        async def abort(request: Request):
            body = await _read(request, AbortBody)
            loop.abort(body.request_id, body.reason)  # still computing: the ordinary abort
            result = await loop.call(lambda e: e.abort_kv(body.request_id, body.reader_stopped, body.reason))
            return ControlReply(result=result).to_json()
    else:
        @internal.post("/stop_pull")
        async def stop_pull(request: Request):
            rid = (await _read(request, StopPullBody)).request_id
            loop.abort(rid, "the router gave up on the request")   # processed before the question below
            stopped = await loop.call(lambda e: e.kv_link.stop_pull(rid))
            return StopPullReply(reader_stopped=stopped).to_json()

        @internal.post("/decode")
        async def decode(request: Request):
            _refuse_if_draining()
            body = await _read(request, DecodeBody)
            _refuse_if_unchecked(body)
            return _stream(body, request, **({"kv_source": body.handoff} if body.handoff is not None else {}))

    # last: any other path under the prefix is 401 without the credential and 404 with it, so
    # no one without it tells a prefill node from a decode node by which paths exist (probe)
    @internal.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def no_such_route(rest: str):
        return _error(404, f"no internal route /{rest[:100]} on this {settings.role} node", "not_found")

    app.include_router(internal)
    return internal


def node_app(loop: EngineLoop, settings: PDSettings, tenants: TenantRegistry,
             drain: Drain) -> tuple[FastAPI, ServerState]:
    """A node's whole HTTP app: the status routes of the server (no public generation API),
    the internal routes, and the test-only fault switch where enabled. One function, so that
    a test can hold every /internal route of it to the cluster credential (I11)."""
    from kvfence.server import fault_control
    from kvfence.server.app import ServerState, create_app

    # no public generation API on a node: requests come through the router, its admission, its
    # tenant limits and its scope stamps (pd/scope_epochs.py). A tenant calling a node's /v1
    # directly went around all three: its requests shared the name's cache scope unstamped, so
    # an old party's prompt could land in a scope the router had retired. The tenants file here
    # keys the status routes (/metrics, /health's detail, the console) and the isolation statement.
    state = ServerState(loop, tenants, public_api=False)
    app = create_app(state)
    # before the internal routes' catch-all
    state.keyring = settings.keyring   # SIGHUP reads the node's secret files again
    fault_control.mount(app, settings.keyring)
    refused = Counter("kvfence_pd_internal_refused", "PD nodes: calls to the internal routes (the PD control "
                      "plane) refused for a missing or wrong cluster credential: a party on the network "
                      "without the secret, or a process still on an old one", registry=state.metrics.registry)
    add_internal_routes(app, loop, settings, drain, on_refused=refused.inc)
    return app, state


def serve_node(config: EngineConfig, settings: PDSettings, host: str, port: int, tls: TlsSettings,
               tenants_file: str | None = None, log_level: str = "info", limits: HttpLimits | None = None,
               drain_limit_s: float | None = None) -> int:
    from kvfence.server.isolation import run_startup_checks
    from kvfence.server.serve import load_tenants, refuse_unusable_port, run_until_engine_fails

    if settings.role == "decode":
        config.enable_prefix_cache = False  # decode's KV arrives by transfer; nothing to reuse
    tenants = load_tenants(tenants_file, node=True)
    if tenants.single_tenant:   # the running share, as on a single node, with the tenants file
        config.tenant_running_share = 1.0   # (launch-pd gives the nodes the router's)
    refused = refuse_unusable_port(host, port, f"{settings.role} node")   # before the model loads
    if refused is not None:
        return refused

    loop = EngineLoop(lambda: build_node_engine(config, settings), run_startup_checks,
                      name=f"kvfence-{settings.role}").start()
    if not loop.wait_ready():
        log.error("%s node not serving: %s", settings.role, loop.error)
        return 2
    assert loop.facts is not None
    loop.facts = {**loop.facts, "pd_security": tls.describe()}   # for /internal/info and the statement
    exit_now: list = []
    drain = Drain(lambda: loop.snapshot, lambda: exit_now[0](), limit_s=drain_limit_s or DEFAULT_LIMIT_S)
    app, state = node_app(loop, settings, tenants, drain)
    faults.announce(log)
    certificates = " (client certificates required)" if tls.serving and tls.ca else ""
    server = uvicorn_server(app, host, port, limits or HttpLimits(), log_level, refusals=state.metrics.connections,
                            listening=lambda scheme, bound: log.info(
                                "%s node serving its internal API on %s://%s:%d/internal%s", settings.role, scheme,
                                host, bound, certificates),
                            **uvicorn_options(tls, client_certificates=True))
    exit_now.append(lambda: setattr(server, "should_exit", True))
    stop_at_once = server.handle_exit

    def handle_exit(sig, frame) -> None:
        # the first SIGTERM drains (the router stops routing here, what is here finishes);
        # a second one, or SIGINT, stops at once
        if sig == signal.SIGTERM and drain.start("SIGTERM"):
            return
        stop_at_once(sig, frame)
    server.handle_exit = handle_exit
    return run_until_engine_fails(server, loop)
