"""The OpenAI-compatible HTTP API: routes, and the life of one request on the server side.

auth (tenant from the API key) -> ready? -> body -> model -> tokenize -> admission against
the usable context (I4; the engine checks again) -> tenant limits -> engine, then stream or
collect, with a client disconnect turned into an engine abort that gives the pages back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import signal
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded, Overloaded, check_fits, completion_tokens
from kvfence.engine.grammar import GrammarError, build_matcher, ll_tokenizer, schema_digest
from kvfence.engine.params import SamplingParams, canonical_schema
from kvfence.engine.schema_check import SchemaChecker, SchemaTooCostly
from kvfence.model.tokenizer import ChatTemplateError
from kvfence.pd.seal import Keyring, SecretError, describe_secrets
from kvfence.server import legacy_functions, responses_api
from kvfence.server.auth_throttle import FailedAuthThrottle, client_address
from kvfence.server.backend import DEAD_STATES, EngineBackend, EngineFailed, RequestHandle, Update
from kvfence.server.disconnect import watch_disconnect
from kvfence.server.early_sighup import EARLY_HUP, hold_sighup
from kvfence.server.errors import (
    ABORT_STATUS,
    INTERNAL_ERROR,
    NOT_TAKEN_CODES,
    OWN_DETAIL_CODES,
    APIError,
    abort_status,
    bad_request,
    error_body,
)
from kvfence.server.fair_queue import FairWorker
from kvfence.server.isolation import isolation_statement, tenant_view
from kvfence.server.json_slices import encode as encode_json
from kvfence.server.log_budget import LogBudget
from kvfence.server.metrics import CONTENT_TYPE, KeyringCollector, ServerMetrics
from kvfence.server.openai_format import Formatter, sse, usage
from kvfence.server.protocol import (
    MAX_CHOICES,
    OFF_LOOP_BYTES,
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    read_json_body,
)
from kvfence.server.responses_api import ResponseView
from kvfence.server.streaming import event_stream
from kvfence.server.tenants import (
    UNAUTHENTICATED,
    Lease,
    Tenant,
    TenantLimiter,
    TenantRegistry,
    TenantsFileError,
    prompt_cap_refusal,
    registry_change,
)
from kvfence.server.tools import (
    CallStream,
    TextBeforeCalls,
    ToolSpec,
    call_cut_before_its_name,
    enforced_answer_whole,
    enforced_parameters,
    parse_answer,
)
from kvfence.server.tools import render as render_tools

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("kvfence.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_FRAMES_LOGGED = 12
# logprob entries one answer may carry, echoed prompt or generated (each a Python object, then JSON: ~100 MB)
MAX_LOGPROB_ENTRIES = 1_000_000


class ServerState:
    def __init__(self, engine: EngineBackend, tenants: TenantRegistry, served_model_name: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, owns_engine: bool = True, public_api: bool = True):
        self.engine = engine
        # False on a PD node: no /v1 generation or model routes, so nothing reaches its engine
        # around the router's admission, tenant limits and scope stamps
        self.public_api = public_api
        self.tenants = tenants
        self.limiter = TenantLimiter()
        self.metrics = ServerMetrics(engine)
        self.key_throttle = FailedAuthThrottle()   # wrong operator or scraper keys, per address (console too)
        self.refusal_lines = LogBudget()   # log lines for tenants' refused requests
        self.max_body_bytes = max_body_bytes
        self.owns_engine = owns_engine
        self._served = served_model_name
        self._reloading = asyncio.Lock()
        self.last_reload: dict | None = None   # the operator console shows it, and
        self.last_good_reload: dict | None = None   # the last that worked (a failed one hid it)
        self._paused: frozenset[str] = frozenset()   # names whose scope a reload is retiring now
        self._schema_checker: SchemaChecker | None = None
        # schema checks waiting or running, by tenant name (app.py's _check_schema; the event loop's only)
        self.schema_checks_by_tenant: dict[str, int] = {}
        # (tenant, scope epoch, schema digest) -> the check's verdict; the schema thread's only
        self.schema_verdicts: OrderedDict[tuple[str, int, str], tuple[str, str] | None] = OrderedDict()
        self._schema_checker_lock = threading.Lock()
        self._closed = False   # after close() no checker is built again (its worker would outlive the server)
        # a PD process's cluster secrets (pd/seal.py), read again on SIGHUP; None: not a PD process
        self.keyring: Keyring | None = None
        self.last_secret_reload: dict | None = None
        self.metrics.registry.register(KeyringCollector(lambda: self.keyring))
        for note in self._context_notes(tenants):   # load_tenants said the others, not knowing the context
            log.warning("%s", note)

    def _context_notes(self, tenants: TenantRegistry) -> list[str]:
        """tenants' limits the served context makes moot (a PD node applies none; none before
        the engine is ready)."""
        usable = (self.engine.facts or {}).get("usable_context")
        return tenants.context_notes(usable) if self.public_api and usable else []

    @property
    def schema_checks_queued(self) -> int:
        return sum(self.schema_checks_by_tenant.values())

    @property
    def schema_checker(self) -> SchemaChecker:
        """Compiles clients' schemas under a deadline in a worker process (built on first use:
        the engine's tokenizer exists once it is ready)."""
        with self._schema_checker_lock:
            if self._closed:
                raise RuntimeError("the server is stopping")
            if self._schema_checker is None:
                self._schema_checker = SchemaChecker(self.engine.tokenizer, self.facts["vocab_size"])
            return self._schema_checker

    def close(self) -> None:
        with self._schema_checker_lock:
            self._closed = True
            if self._schema_checker is not None:
                self._schema_checker.close()

    def refuse_if_paused(self, tenant: Tenant) -> None:
        if tenant.name in self._paused:
            raise APIError(503, "This API key's tenant is being reconfigured; retry in a moment.",
                           code="server_overloaded", outcome="not_ready")

    @property
    def served_name(self) -> str:
        if self._served:
            return self._served
        return (self.engine.facts or {}).get("default_served_name") or "kvfence"

    def ensure_ready(self) -> None:
        st = self.engine.state
        if st == "ready":
            return
        if st == "loading":
            raise APIError(503, "The model is still loading; try again shortly.", code="model_not_ready")
        why = self.engine.error or "stopped"
        if not self.tenants.single_tenant:   # the reason names nodes and internals: the operator's
            why = "the operator's log and /health (with the [metrics] or [operator] key) say why"
        # a router waits for a node to come back (seconds: a restart and its check), a failed
        # single node for its supervisor to restart it
        raise APIError(503, f"The engine is not serving ({st}): {why}.", code="engine_unavailable")

    @property
    def facts(self) -> dict:
        """The backend's static facts; they exist once it is ready (503 before)."""
        f = self.engine.facts
        if f is None:
            raise APIError(503, "The model is still loading; try again shortly.", code="model_not_ready")
        return f

    def statement(self) -> dict:
        return isolation_statement(self.facts, self.engine.startup_checks, self.tenants,
                                   self.engine.snapshot, self.served_name)

    async def reload_tenants(self, why: str) -> dict:
        """Read the tenants file again and serve by it from now on (SIGHUP, or the operator's
        POST /v1/kvfence/tenants/reload). A file that does not load changes nothing
        (TenantsFileError). Requests whose key no longer names their tenant end with 401
        api_key_revoked; the cache scopes of removed tenants (and of names whose keys were all
        replaced) are retired on this engine, or behind the router on every node. Limits apply
        to new requests; concurrency and tokens-per-minute counts carry over by tenant name."""
        async with self._reloading:   # one at a time: a SIGHUP beside the route would interleave
            try:
                new = await asyncio.to_thread(self.tenants.reread)
            except TenantsFileError as e:
                self.metrics.tenant_reloads.labels("error").inc()
                self.last_reload = {"at": time.time(), "trigger": why, "result": "error", "error": str(e)}
                log.error("tenants file not reloaded (%s): %s; still serving by the previous one", why, e)
                raise
            change = registry_change(self.tenants, new)
            new.succeed(self.tenants, change["retired"])
            old_operator, old_metrics = bool(self.tenants.operator_digests), bool(self.tenants.metrics_digests)
            # a retired name's new party waits until every node has retired the old scope: its
            # request could otherwise reach a prefill node first and attach the old pages
            self._paused = frozenset(change["retired"])
            self.tenants = new
            # from here the new file is in force: what fails below is logged, and the reload stands
            try:
                change["requests_revoked"] = self.limiter.revoke_unless(
                    lambda lease: new.accepts(lease.key, lease.tenant.name))
            except Exception:   # noqa: BLE001 - a callback's bug must not undo the swap
                log.exception("revoking requests in flight failed; new requests are served by the new file")
                change["requests_revoked"] = None
            self.limiter.forget(change["retired"])
            try:
                # a PD node serves no tenant itself: its scopes are the router's to retire (by its
                # message and its stamps); retiring here as well only dropped the new party's pages
                change["prefix_pages_retired"] = (await self.engine.forget_tenants(change["retired"], new.reloads)
                                                  if self.public_api else 0)
            except Exception as e:   # noqa: BLE001 - e.g. a failed engine, whose pool is never read again
                log.warning("retired tenants' cached prefix pages not retired: %s", e)
                change["prefix_pages_retired"] = None
            finally:
                self._paused = frozenset()
        self.metrics.tenant_reloads.labels("ok").inc()
        self.last_reload = self.last_good_reload = {"at": time.time(), "trigger": why, "result": "ok", **change}
        for note in (new.notes() if self.public_api else []) + self._context_notes(new):
            log.warning("%s", note)
        for section, changed, had, has, lost in (
                ("[operator]", change["operator_keys_changed"], old_operator, bool(new.operator_digests),
                 "the console and the reload route are off (SIGHUP still reloads)"),
                ("[metrics]", change["metrics_keys_changed"], old_metrics, bool(new.metrics_digests),
                 "a Prometheus scraper with the old key now gets 401")):
            if changed and had and not has:
                log.warning("tenants file %s reloaded without %s keys: %s", new.source, section, lost)
            elif changed:
                log.info("tenants file %s: the %s keys changed", new.source, section)
        log.info("tenants file %s reloaded (%s): %d tenant(s); added %s, removed %s, changed %s; %d key(s) revoked, "
                 "%d added; %s request(s) in flight ended; %s cached prefix page(s) retired", new.source, why,
                 change["tenants"], change["added"] or "none", change["removed"] or "none",
                 change["changed"] or "none", change["keys_revoked"], change["keys_added"],
                 change["requests_revoked"], change["prefix_pages_retired"])
        return change


    def reload_secrets(self, why: str) -> bool:
        """Read a PD process's cluster secret files again (SIGHUP), so a cluster rotates its
        secret without restarts (docs/pd.md). A file that fails its checks changes nothing.
        Returns whether the new set is in force."""
        if self.keyring is None or not self.keyring.reloadable:
            return False
        try:
            before, after = self.keyring.reload()
        except SecretError as e:
            self.metrics.secret_reloads.labels("error").inc()
            self.last_secret_reload = {"at": time.time(), "trigger": why, "result": "error", "error": str(e)}
            log.error("cluster secrets not reloaded (%s): %s; still using the previous ones", why, e)
            return False
        self.metrics.secret_reloads.labels("ok").inc()
        self.last_secret_reload = {"at": time.time(), "trigger": why, "result": "ok", "key_ids": after.key_ids}
        log.info("cluster secrets reloaded (%s): %s%s", why, describe_secrets(after),
                 " (unchanged)" if after == before else f" (was: {describe_secrets(before)})")
        return True


class KeyRevoked(Exception):
    """A reload of the tenants file took the request's key away while it ran."""

    @staticmethod
    def api_error() -> APIError:
        return APIError(401, "The API key of this request was revoked while it ran (the operator reloaded the "
                             "tenants file); it was stopped.", code="api_key_revoked", outcome="key_revoked")


def _reload_on_sighup(state: ServerState) -> bool:
    """SIGHUP reloads the tenants file, as it reloads nginx's or Prometheus's configuration,
    and a PD process's cluster secret files (without either it is logged and ignored: its
    default action would stop the server). Only the process's main thread can take signals:
    a server run in another thread (the tests' servers) has the reload route alone. Returns
    whether the handler is set."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()

    async def reload() -> None:
        try:
            await state.reload_tenants("SIGHUP")
        except TenantsFileError:
            pass   # logged and counted by reload_tenants

    def on_hup() -> None:
        secrets = state.reload_secrets("SIGHUP") if state.keyring is not None else None
        if state.tenants.source is None:
            if secrets is None:
                log.warning("SIGHUP ignored: no tenants file to reload (single-tenant mode)")
            return
        task = loop.create_task(reload())
        pending.add(task)
        task.add_done_callback(pending.discard)

    try:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    except (RuntimeError, ValueError):   # not the main thread
        return False
    if EARLY_HUP.is_set():   # the file may have changed while the model loaded
        EARLY_HUP.clear()
        on_hup()
    return True


def may_scrape(state: ServerState, request: Request, route: str, public_part: bool = False,
               tenant_part: bool = False) -> bool:
    """Whether the request carries a key that reads what the operator sees (/metrics, the
    router's per-node state): always without a tenants file. Wrong keys are bounded per address
    as the console's are (429 once too many); no key at all, or a tenant's own, teaches nothing
    and is not counted. `public_part`: the route has an answer for everyone (/health, the
    cluster's readiness), which a throttled address still gets: else anyone sharing the probe's
    address (a NAT, the ingress) could turn readiness probes into 429s with wrong keys.
    `tenant_part`: it has one for each tenant (the isolation statement), which a throttled
    address still gets with a tenant's key; any other key there is the 429, not a 401 that
    tells the operator its right key is wrong."""
    address = client_address(request)   # as the console counts it: one table (auth_throttle.py)
    authorization = request.headers.get("authorization")
    wait = state.key_throttle.retry_after(address)
    if wait is not None:
        if public_part or (tenant_part and state.tenants.is_tenant_key(authorization)):
            return False
        raise APIError(429, f"Too many wrong keys from this address (for {route}, the console and the other "
                            f"operator routes: one count); try again in {wait} s.",
                       code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
    if state.tenants.may_scrape(authorization):
        return True
    if authorization and not state.tenants.is_tenant_key(authorization):
        state.key_throttle.failed(address)   # a guess (a tenant's own key is not one)
    return False


def detail_withheld(state: ServerState, request: Request) -> str | None:
    """Why a route with a public part (may_scrape's public_part) left out its detail for a
    request that sent a key: its address is throttled for wrong keys. The status still answers
    (a probe behind a shared address must not turn 429), but a scraper whose detail vanished is
    told why (a docs probe: it was dropped in silence)."""
    if not request.headers.get("authorization"):
        return None
    wait = state.key_throttle.retry_after(client_address(request))
    return None if wait is None else f"too many wrong keys from this address; try again in {wait} s"


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        hup = _reload_on_sighup(state)
        try:
            yield
        finally:
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                hold_sighup()
            await asyncio.to_thread(state.close)   # it may wait for a check in progress
            if state.owns_engine:
                await asyncio.to_thread(state.engine.stop)

    # the route list (console, test faults) is nobody's business; no trailing-slash redirects:
    # Starlette builds their Location from the client's Host header (the 404 names the route)
    app = FastAPI(title="kvfence", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.kvfence = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _with_request_id(request, e.response())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = f"No route {request.method} {request.url.path}." if e.status_code in (404, 405) else str(e.detail)
        path = request.url.path
        if e.status_code == 404 and path.endswith("/") and path.rstrip("/") in _plain_paths(app):
            msg += f" Did you mean {path.rstrip('/')}?"
        elif e.status_code in (404, 405) and (path in _STORED_APIS or path.startswith(_STORED_ITEMS)):
            # a client that sent store: true looks its answer up (OpenAI's stored completions)
            msg += (" kvfence stores no chat completion or response ('store' is accepted and ignored; text lives "
                    "only in memory for the life of its request): there is nothing to list or retrieve.")
        elif e.status_code in (404, 405) and any(path == p or path.startswith(p + "/") for p in _OTHER_OPENAI_APIS):
            msg += (" This part of the OpenAI API is not served here: kvfence serves a text generation model "
                    "(/v1/chat/completions, /v1/completions, /v1/responses and /v1/models).")
        return JSONResponse(error_body(msg, "invalid_request_error", None, None), status_code=e.status_code)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, e: RecursionError):
        # the body is parsed off the event loop, where the stack is shallower: JSON nested just
        # short of the parser's limit parses there, then fails to print (tool parameters into
        # the prompt, a Responses echo) on the loop. A client's doing, not a server error; the
        # known places convert it themselves, so one reaching here is logged: it may be ours
        log.warning("RecursionError on %s %r (request %s) answered as a too deeply nested body (400); if the body "
                    "was not deeply nested, this is a server bug", request.method, request.url.path,
                    getattr(request.state, "request_id", "-"))
        return _with_request_id(request, bad_request("The request body is nested too deeply.").response())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # where it failed, so that a 500 can be looked into; not its message, which may quote
        # the client's text (nothing of a prompt is logged)
        where = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)[-MAX_FRAMES_LOGGED:]))
        log.error("unhandled %s on %s %s (request %s), raised at (innermost last):\n%s", type(e).__name__,
                  request.method, request.url.path, getattr(request.state, "request_id", "-"), where.rstrip())
        state.metrics.failures.labels(INTERNAL_ERROR).inc()
        return _with_request_id(request, JSONResponse(error_body("Internal server error.", "server_error", None,
                                                                 None), status_code=500))

    # -- operational endpoints -------------------------------------------------------------
    @app.get("/")
    async def root(request: Request):
        """Someone pointed a browser or curl at the bare address: say what answers here. A
        browser goes to the operator console where one is on; nothing else is listed (no
        route map: see the FastAPI app's openapi_url)."""
        console_on = bool(state.tenants.operator_digests)
        if console_on and "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/console", status_code=303)
        return {"service": "kvfence",
                "openai_base_url": "/v1" if state.public_api else None,
                "health": "/health",
                "console": "/console" if console_on else None}

    # HEAD too: load balancers' health checks often send it
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        st = state.engine.state
        snap = state.engine.snapshot
        body = {"status": "ok" if st == "ready" else st, "ready": st == "ready", "alive": st not in DEAD_STATES}
        # the live counts follow every tenant's load, and why it failed names the router's nodes
        # (URLs, states) or the engine's internals: with a tenants file, for the [metrics] or
        # [operator] key only (probes need the status alone)
        if may_scrape(state, request, "/health", public_part=True):
            body |= {"running": snap.get("running"), "waiting": snap.get("waiting")}
            if snap.get("fleet"):   # a router: ready with half its decode nodes down is worth a look
                body["nodes"] = snap["fleet"]
            if state.engine.error:
                body["error"] = state.engine.error
        elif (why := detail_withheld(state, request)) is not None:
            body["detail_withheld"] = why
        return JSONResponse(body, status_code=200 if st == "ready" else 503)

    @app.api_route("/health/live", methods=["GET", "HEAD"])
    async def live():
        st = state.engine.state
        alive = st not in DEAD_STATES
        return JSONResponse({"alive": alive, "status": st}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        # its series name every tenant: with a tenants file, only the [metrics] or [operator] key
        # reads them (server/tenants.py)
        if not may_scrape(state, request, "/metrics"):
            raise APIError(401, "/metrics names every tenant: send the tenants file's [metrics] (or [operator]) "
                           "key as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # -- OpenAI API ------------------------------------------------------------------------
    if state.public_api:
        _openai_routes(app, state)

    @app.get("/v1/kvfence/isolation")
    async def isolation(request: Request):
        # the operator's and the scraper's key (it reads every tenant's series anyway) get the
        # whole statement, as one tenant's server does; a tenant sees its own part. Wrong keys
        # count against the address as on /metrics (200 against 401 told a guesser which key
        # opens the console); a throttled address still gets a tenant's own view, any other key 429
        whole = may_scrape(state, request, "/v1/kvfence/isolation", tenant_part=True)
        tenant = None if whole else state.tenants.authenticate(request.headers.get("authorization"))
        state.ensure_ready()
        return state.statement() if tenant is None else tenant_view(state.statement(), tenant)

    from kvfence.server import console  # the operator console (/console), behind the operator key
    console.mount(app, state)
    return app


def _openai_routes(app: FastAPI, state: ServerState) -> None:
    """The public OpenAI API: models, completions, chat completions."""
    @app.get("/v1/models")
    async def models(request: Request):
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(state, tenant)] if state.engine.facts else []}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        if not state.engine.facts or model != state.served_name:
            raise APIError(404, f"The model '{model}' does not exist.", code="model_not_found", param="model")
        return _model_card(state, tenant)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, "completion")

    # vLLM's extension routes, for clients that count tokens before they send: the same key
    # as generation, the same tokenizer and chat template, nothing reaches the engine
    @app.post("/tokenize")
    async def tokenize(request: Request):
        tenant, key = state.tenants.identify(request.headers.get("authorization"))
        state.ensure_ready()
        lease = state.limiter.hold(tenant, key)    # the tenant's concurrency limit, as generation
        try:
            body = await read_json_body(request, state.max_body_bytes)
            prompt, add_prompt, tools, continue_final = parse_tokenize(body)
            tok, ctx = state.engine.tokenizer, state.facts["usable_context"]
            # only what could be sent: the ids of a longer text (8 MB of words gave ~1M) took
            # seconds to encode as JSON on the event loop, every tenant's streams waiting
            if isinstance(prompt, str):
                _refuse_surely_too_long(tok, prompt, ctx, "prompt", max_param=None)
                ids = await asyncio.to_thread(tok.encode, prompt)
            else:   # rendered as _tokenize renders a chat request: tool calls, results and tools alike
                ids = await _encode_chat(tok, prompt, tools, add_prompt, ctx, max_param=None,
                                         continue_final=continue_final)
            if len(ids) > ctx:
                raise APIError(400, f"The prompt is {len(ids)} tokens, more than this model's context of {ctx} "
                                    "tokens.", code="context_length_exceeded",
                               param="prompt" if isinstance(prompt, str) else "messages", outcome="rejected")
            if lease.revoked:   # a reload took the key while it was tokenized
                raise KeyRevoked.api_error()
        finally:
            lease.release()
        return {"count": len(ids), "max_model_len": ctx, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tenant, key = state.tenants.identify(request.headers.get("authorization"))
        state.ensure_ready()
        lease = state.limiter.hold(tenant, key)
        try:
            ids = parse_detokenize(await read_json_body(request, state.max_body_bytes))
            ctx = state.facts["usable_context"]
            if len(ids) > ctx:   # a million ids of 81 characters each was an 85 MB text and reply
                raise bad_request(f"'tokens' may hold at most this model's context of {ctx} ids.", param="tokens")
            vocab = state.facts["vocab_size"]
            if any(t < 0 or t >= vocab for t in ids):
                raise bad_request(f"Token ids must be in [0, {vocab}).", param="tokens")
            text = await asyncio.to_thread(state.engine.tokenizer.decode, ids, False)
            if lease.revoked:
                raise KeyRevoked.api_error()
        finally:
            lease.release()
        return {"prompt": text}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, "chat")

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _generate(state, request, "responses")   # a view of chat (server/responses_api.py)


def _model_card(state: ServerState, tenant: Tenant) -> dict:
    """The model as the caller's key sees it: the context, and with a tenants file the key's
    own limits (null: none), so a client can size its requests before one is refused. Only
    its own: another tenant's limits say nothing it may know."""
    f = state.facts
    card = {"id": state.served_name, "object": "model", "created": 0, "owned_by": "kvfence",
            "max_model_len": f["usable_context"], "fingerprint": f["fingerprint"],
            # prompts x n: the protocol's bound, or fewer where a tenant's queue places are fewer
            "max_choices": min(MAX_CHOICES, f.get("tenant_waiting_places") or MAX_CHOICES)}
    if not state.tenants.single_tenant:
        card["tenant_limits"] = dataclasses.asdict(tenant.limits)
    return card


_REJECTION_REASON = {"context_length_exceeded": "context_length_exceeded",
                     "tenant_max_prompt_tokens": "tenant_max_prompt_tokens",
                     "tenant_max_concurrent_requests": "tenant_max_concurrent_requests",
                     "tenant_tokens_per_minute": "tenant_tokens_per_minute",
                     "tenant_requests_per_minute": "tenant_requests_per_minute",
                     "invalid_api_key": "unauthorized", "model_not_found": "model_not_found",
                     "model_not_ready": "not_ready", "engine_unavailable": "not_ready",
                     "server_overloaded": "server_overloaded", "server_shutting_down": "not_ready"}




async def _generate(state: ServerState, request: Request, kind: str):
    arrival = time.perf_counter()
    rid = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp-"}[kind] + uuid.uuid4().hex
    request.state.request_id = rid   # every answer carries it (x-request-id), as the operator's log does
    tenant: Tenant | None = None
    lease: Lease | None = None
    choices: list[_Choice] = []
    view: ResponseView | None = None
    try:
        tenant, key = state.tenants.identify(request.headers.get("authorization"))
        state.ensure_ready()
        state.refuse_if_paused(tenant)
        # the tenant's concurrency slot from here: reading, parsing, templating and tokenizing a
        # large body is seconds of CPU, spent within the tenant's limit, not beside it
        lease = state.limiter.hold(tenant, key)
        # a reload that revokes the key from here on stops the request: before it runs, this
        # event (which abandons a submit in progress); once it runs, _Run.revoke
        revoked = asyncio.Event()
        lease.on_revoke = revoked.set
        # after each wait from here a revoked key's answer is its 401: before the body is parsed,
        # and instead of whatever was wrong with the body (too large, cut off)
        try:
            body = await read_json_body(request, state.max_body_bytes, before_parse=lambda: _refuse_if_revoked(revoked))
        except APIError:
            _refuse_if_revoked(revoked)
            raise
        if kind == "responses":
            view = ResponseView(body, rid, state.served_name)
        parse = parse_completion if kind == "completion" else parse_chat

        def parsed() -> GenerationRequest:
            return parse(responses_api.chat_body(body) if kind == "responses" else body)
        # a body parsed off the event loop is checked off it too: 125K Responses items or an
        # 8 MiB tool schema took ~1 s of Python, and a long id list inside a short list (or a
        # long conversation) seconds, during which every stream and /health/live stalled
        big = request.state.body_bytes > OFF_LOOP_BYTES
        req = await asyncio.to_thread(parsed) if big else parsed()
        _refuse_if_revoked(revoked)
        if req.model is not None and req.model != state.served_name:
            raise APIError(404, f"The model '{req.model}' does not exist.", code="model_not_found", param="model")
        _refuse_max_tokens_beyond_context(req, state.facts["usable_context"])
        _refuse_more_choices_than_wait(req, state.facts.get("tenant_waiting_places"))
        cap = tenant.limits.max_prompt_tokens
        facts = state.facts
        prompts = []
        for text, pids in req.prompts:
            try:
                prompts.append(await _tokenize(state, req, text, pids, cap))
            except APIError:   # revoked while tokenizing: its 401, not what the prompt got (empty, ...)
                _refuse_if_revoked(revoked)
                raise
            _refuse_if_revoked(revoked)
            # each as soon as it is tokenized: a list of long texts was all tokenized first
            _refuse_if_too_long(prompts[-1], req, facts["usable_context"])
        _limit_implicit_max_tokens(req, tenant, prompts, facts["usable_context"])
        if view is not None:   # the Response says the limit that applied, the tenant's own included
            view.max_output_tokens = req.params.max_tokens
        for (_, pids), ids in zip(req.prompts, prompts):
            _refuse_if_too_long(ids, req, facts["usable_context"])   # with the max_tokens now applied
            if pids is not None:   # after I4: an over-length id list is refused before any per-id work
                vocab = facts["vocab_size"]
                if any(t < 0 or t >= vocab for t in ids):
                    raise bad_request(f"Prompt token ids must be in [0, {vocab}).", param="prompt")
        if req.params.prompt_logprobs is not None:   # every choice's answer repeats the prompt's entries
            entries = sum(len(ids) for ids in prompts) * (req.params.prompt_logprobs + 1) * req.n
            if entries > MAX_LOGPROB_ENTRIES:
                raise bad_request(f"echo with logprobs would return {entries} logprob entries (prompt tokens x "
                                  f"(logprobs + 1) x n); at most {MAX_LOGPROB_ENTRIES}: send fewer prompt "
                                  "tokens, a smaller logprobs or n.", param="logprobs")
        # the most completion tokens this request can use: max_tokens, or the rest of the context
        # when it sets none (what the engine will allow), for every choice (n choices of a prompt
        # may use n x max_tokens); it bounds the logprobs and tokens_per_minute reserves it
        usable = facts["usable_context"]
        most = sum(completion_tokens(req.params.max_tokens, len(ids), usable) for ids in prompts) * req.n
        if req.params.logprobs is not None:   # the answer is built whole on the event loop: bound it
            entries = most * (req.params.logprobs + 1)
            if entries > MAX_LOGPROB_ENTRIES:
                raise bad_request(f"logprobs could return {entries} entries (tokens x (top logprobs + 1) x n); at "
                                  f"most {MAX_LOGPROB_ENTRIES}: set a smaller max_tokens, top logprobs or n.",
                                  param="logprobs" if req.kind == "completion" else "top_logprobs")
        bad_bias = [t for t in req.params.logit_bias if t >= facts["vocab_size"]]
        if bad_bias:
            raise bad_request(f"'logit_bias' names token {bad_bias[0]}, outside the vocabulary "
                              f"[0, {facts['vocab_size']}).", param="logit_bias")
        bad_stop = [t for t in req.params.stop_token_ids if t >= facts["vocab_size"]]
        if bad_stop:   # the model can never write it: the stop would silently never apply
            raise bad_request(f"'stop_token_ids' names token {bad_stop[0]}, outside the vocabulary "
                              f"[0, {facts['vocab_size']}).", param="stop_token_ids")
        grammar = await _check_schema(state, req, tenant) if req.params.json_schema is not None else None
        if req.logprobs is not None:   # logprobs' bytes come from llguidance's view of the vocabulary:
            # built once (~0.2 s), off the event loop
            await asyncio.to_thread(ll_tokenizer, state.engine.tokenizer, facts["vocab_size"])
        _refuse_if_revoked(revoked)
        # tokens_per_minute reserves prompt + the most it can generate; what it did not use is refunded
        state.limiter.charge(lease, sum(len(ids) for ids in prompts), most, param=req.max_tokens_param,
                             prompt_param=req.prompt_param)
        request.state.rate_headers = state.limiter.rate_headers(tenant)   # with this request counted
        choices = _choices(state, req, prompts, rid, grammar)
        try:
            # every choice is admitted before anything streams: one by one as the answer ran, a
            # later choice could be refused (a full queue, another tenant's load) after the
            # first had streamed. The first choice of each prompt first; the others start after
            # its prefill, attaching its prompt pages (`after`; the PD router orders them itself,
            # its submit lasting until decode has the KV: all are submitted at once there)
            groups = [choices] if state.engine.orders_choices else \
                [[c for c in choices if c.lead], [c for c in choices if not c.lead]]
            for group in groups:
                await _submit_unless_gone(state, request, group, tenant, revoked)
        except KeyRevoked as e:
            _abort_all(state, choices, "API key revoked")
            raise e.api_error() from None
        except _ClientGone:
            _abort_all(state, choices, "client disconnected")
            lease.release()
            state.metrics.finished(tenant.name, "client_disconnected")
            return Response(status_code=499)  # nobody is listening; the request never started
        except ContextLengthExceeded as e:
            raise _too_long(e, req) from None
        except Overloaded as e:
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": str(e.retry_after_s)},
                           outcome="overloaded") from None
        except EngineFailed as e:  # the PD router's failures carry a machine-readable code
            if e.code == "scope_retired":   # a node had retired the scope by the reload that revoked the key
                raise KeyRevoked.api_error() from None
            status, what = ABORT_STATUS.get(e.code, (503, "The engine is not available"))
            failed = status >= 500 and e.code not in NOT_TAKEN_CODES   # taken, then lost: not "not ready"
            if failed:
                state.metrics.failures.labels(e.code or "engine_unavailable").inc()
            raise APIError(status, f"{what}: {_public_detail(state, rid, tenant, e.code, str(e))}.", code=e.code,
                           outcome="error" if failed else None) from None
        except GrammarError as e:
            raise bad_request(str(e), param="response_format") from None
        except ValueError as e:   # NotServedHere has a code of its own
            raise bad_request(str(e), param=req.prompt_param, code=getattr(e, "code", None)) from None
        run = _Run(state, request, choices, tenant, lease, arrival, req, kind)   # from here run.close() frees the slot
        lease.on_revoke = run.revoke
        if lease.revoked:   # a reload took the key while it was parsed or submitted
            run.revoke()
    except APIError as e:
        if lease is not None:
            lease.release(_tokens_generated(choices))
            _abort_all(state, choices, "another choice of the request was refused")
        if kind == "responses":
            e = responses_api.refused(e)
        _count_refusal(state, tenant, e)
        # a tenant's refusals, so that "my requests get 400" can be looked up by request id;
        # the code and the parameter, never the message (it may quote what the client sent).
        # Anyone without a key is at debug: they could fill the log a line per request.
        # A tenant's lines are budgeted (log_budget.py): a client looping on a refusal adds a few.
        who = tenant.name if tenant else UNAUTHENTICATED
        if tenant is not None:   # a 429's client learns where its minute stands, as after an answer
            request.state.rate_headers = state.limiter.rate_headers(tenant)
        left_out = state.refusal_lines.take(who) if tenant is not None else 0
        if left_out is not None:
            log.log(logging.INFO if tenant is not None else logging.DEBUG, "%s tenant=%s refused: %s %s%s%s", rid,
                    who, e.status, e.code, f" param={e.param[:64]!r}" if e.param else "",   # quoted: never a line break
                    f" ({left_out} earlier refusal(s) of this tenant not logged)" if left_out else "")
        return _with_request_id(request, e.response())
    except BaseException:   # a bug, or the task cancelled while it read the body: the slot still goes back
        if lease is not None:
            lease.release()
            _abort_all(state, choices, "the request failed before it ran")
        raise
    if view is not None:
        if req.stream:
            return _with_request_id(request, event_stream(view.events(run.chunks()), run.close))
        done = await run.result()
        # the chat answer was built already (run.result); rewrapping it refers to its lists
        return _with_request_id(request, await json_answer(view.response(done)))
    if req.stream:
        return _with_request_id(request, event_stream(run.events(), run.close))
    return _with_request_id(request, await run.collect())


def _with_request_id(request: Request, response: Response) -> Response:
    """The request's id in x-request-id (what the official client reads as `_request_id`), so a
    client can quote it and the operator find it in the log; and once the tenant is known, its
    x-ratelimit-* headers."""
    rid = getattr(request.state, "request_id", None)
    if rid is not None:
        response.headers["x-request-id"] = rid
    response.headers.update(getattr(request.state, "rate_headers", {}))   # the tenant's per-minute limits
    return response


_STORED_APIS = ("/v1/chat/completions", "/v1/responses")
_STORED_ITEMS = tuple(p + "/" for p in _STORED_APIS)
# routes of OpenAI's API that a text model does not have: a client (a RAG framework's
# embeddings, an upload) got a bare "No route", as for a typo
_OTHER_OPENAI_APIS = tuple(f"/v1/{p}" for p in (
    "embeddings", "audio", "images", "moderations", "files", "uploads", "batches", "fine_tuning", "assistants",
    "threads", "vector_stores", "realtime", "containers", "evals", "videos", "conversations"))


def _plain_paths(app: FastAPI) -> set[str]:
    """The routes without path parameters, for a 404's hint."""
    return {p for r in app.routes if "{" not in (p := getattr(r, "path", "{"))}


async def _check_schema(state: ServerState, req: GenerationRequest, tenant: Tenant) -> LLMatcher | None:
    """A 400 that names what llguidance cannot compile, before anything reaches an engine (on
    every role: in PD mode decode compiles it again only after prefill has run), and where the
    client wrote it: an enforced tool call's schema is built from the tools' parameters, so the
    first tool whose parameters fail is named. Compiled in the schema checker's worker under a
    deadline (engine/schema_check.py): one that takes longer is refused, since the engine would
    compile it again on its own thread, between every tenant's forward passes. Returns the
    schema's matcher, built in this thread for an engine that runs here (builds_grammars): the
    engine thread then compiles nothing (a schema that passed still costs up to the deadline)."""
    spec = req.tools if req.tools is not None and (req.tools.enforced or req.tools.answer_schema is not None) else None
    where = "response_format" if spec is None or not spec.enforced else "tools"

    key = (tenant.name, tenant.scope_epoch, schema_digest(str(req.params.json_schema)))

    def check() -> tuple[str, str] | None:
        # a verdict is kept per tenant (its own timing only): a schema sent again skips the worker
        if key in state.schema_verdicts:
            state.schema_verdicts.move_to_end(key)
            return state.schema_verdicts[key]
        found = check_anew()
        state.schema_verdicts[key] = found
        while len(state.schema_verdicts) > SCHEMA_VERDICTS_KEPT:
            state.schema_verdicts.popitem(last=False)
        return found

    def check_anew() -> tuple[str, str] | None:
        checker = state.schema_checker
        try:
            err = checker.check(str(req.params.json_schema))
        except SchemaTooCostly as e:
            return where, str(e)
        if err is None:
            return None
        if spec is None:
            return "response_format", err
        # which part fails, each compiled alone, all of them within one more deadline
        parts = [("response_format", spec.answer_schema)] if spec.answer_schema is not None else []
        allowed = {t["name"] for t in spec.allowed()}
        # each as the combined schema holds it (a tool not strict loses what held_as drops)
        parts += [(f"tools[{i}].function.parameters", canonical_schema(enforced_parameters(t)))
                  for i, t in enumerate(spec.tools) if t["name"] in allowed]
        until = time.monotonic() + checker.deadline_s
        try:
            for param, part in parts:
                if (own := checker.check(part, until - time.monotonic())) is not None:
                    return param, own
        except SchemaTooCostly:
            pass
        return "tools", err     # each compiles alone (or took too long to tell); together they do not

    def check_and_build() -> tuple[str, str] | LLMatcher | None:
        if (found := check()) is not None or not state.engine.builds_grammars:
            return found
        ll = ll_tokenizer(state.engine.tokenizer, state.facts["vocab_size"])
        try:
            return build_matcher(ll, str(req.params.json_schema))
        except GrammarError as e:   # the worker built it a moment ago: not expected
            return where, str(e)

    mine = state.schema_checks_by_tenant.get(tenant.name, 0)
    # a tenant with nothing waiting always gets a place: the total bounds what tenants pile up,
    # it must not let a few of them lock the rest out (found in review)
    if state.schema_checks_queued >= MAX_QUEUED_SCHEMA_CHECKS and mine:
        raise APIError(503, f"{MAX_QUEUED_SCHEMA_CHECKS} structured-output schemas are waiting to be checked; retry "
                       "shortly.", code="server_overloaded", outcome="overloaded")
    if mine >= MAX_QUEUED_SCHEMA_CHECKS_PER_TENANT and not state.tenants.single_tenant:   # one cannot fill it
        raise APIError(429, f"This API key's tenant has {mine} structured-output schemas waiting to be checked; "
                       f"at most {MAX_QUEUED_SCHEMA_CHECKS_PER_TENANT} may wait at once.",
                       code="tenant_max_concurrent_requests", headers={"Retry-After": "1"})
    state.schema_checks_by_tenant[tenant.name] = mine + 1
    try:
        got = await asyncio.wrap_future(_SCHEMA_CHECKS.submit(tenant.name, check_and_build))
    except RuntimeError as e:   # the checker's worker would not start, or the server is stopping
        raise APIError(503, f"Structured output cannot be checked right now ({e}); retry shortly.",
                       code="server_overloaded") from None
    finally:
        if state.schema_checks_by_tenant[tenant.name] <= 1:
            del state.schema_checks_by_tenant[tenant.name]
        else:
            state.schema_checks_by_tenant[tenant.name] -= 1
    if isinstance(got, tuple):
        param, err = got
        refused = bad_request(f"'{param}' has a schema this server cannot enforce: {err}", param=param)
        raise legacy_functions.named_as_sent(refused) if req.legacy_functions else refused
    return got


def _public_detail(state: ServerState, rid: str, tenant: Tenant, code: str | None, detail: str) -> str:
    """What a failure's client learns of its detail. The detail of a node's, transfer's or
    engine's failure names internals (a node's or transfer buffer's address, free pages, an
    exception): with tenants it goes to the log under the request's id, which the client gets
    to quote. A single-tenant server's client is its operator and sees it whole."""
    if state.tenants.single_tenant or code in OWN_DETAIL_CODES:
        return detail
    log.warning("%s tenant=%s failed (%s): %s", rid, tenant.name, code, detail)
    return f"the operator's log has the details under {rid}"


def _too_long(e: ContextLengthExceeded, req: GenerationRequest) -> APIError:
    return APIError(400, e.said_as(f"'{req.prompt_param}'", f"'{req.max_tokens_param}'"),
                    code="context_length_exceeded", param=req.prompt_param, outcome="rejected")


def finish_reason(reason: str | None, calls: bool, cut: bool) -> str:
    """A choice's finish_reason: tool_calls when its answer is calls, except an enforced answer
    (tool_choice required or named) that something cut before its grammar ended (`cut`):
    max_tokens (length), or a stop string or stop token (stop), its last call unfinished. An
    auto answer's calls are whole once found, whatever cut the text after them (vLLM reports
    tool_calls there too)."""
    if calls and not cut:
        return "tool_calls"
    return reason or "stop"


class _ClientGone(Exception):
    pass


def _refuse_if_revoked(revoked: asyncio.Event) -> None:
    """A reload revoked the request's key while it was read, parsed or tokenized: stop here,
    with the 401 the client needs to see, rather than a complaint about its body."""
    if revoked.is_set():
        raise KeyRevoked.api_error()


async def _submit_unless_gone(state: ServerState, request: Request, choices: list[_Choice], tenant: Tenant,
                              revoked: asyncio.Event) -> None:
    """engine.submit for each choice at once (each one's handle set), abandoned (and what was
    admitted aborted) if the client leaves or its key is revoked while they wait (_ClientGone,
    KeyRevoked); the first refusal is raised once every submit has ended (the caller aborts
    those admitted). On a single node submit is only admission; behind the PD router it lasts
    the whole prefill and the KV's transfer to decode. One disconnect watcher for them all (the
    request has one receive)."""
    if revoked.is_set():
        raise KeyRevoked()
    subs = [asyncio.ensure_future(state.engine.submit(c.prompt_ids, c.params, tenant.name, c.rid,
                                                      tenant.public_prefix_scope, scope_epoch=tenant.scope_epoch,
                                                      grammar=c.grammar, after=c.leader.rid if c.leader else None))
            for c in choices]
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(request, gone.set))
    waiters: set[asyncio.Future] = {asyncio.create_task(gone.wait()), asyncio.create_task(revoked.wait())}
    try:
        pending: set[asyncio.Future] = set(subs)
        while pending and not (gone.is_set() or revoked.is_set()):
            _, pending = await asyncio.wait(pending | waiters, return_when=asyncio.FIRST_COMPLETED)
            pending -= waiters
            if any(s.done() and not s.cancelled() and s.exception() is not None for s in subs):
                break   # one was refused: the rest need not wait (the caller aborts what was admitted)
    except BaseException:   # the request itself is cancelled: so is every submit, and what was admitted
        for sub in subs:
            sub.cancel()
        _abort_all(state, choices, "client disconnected")
        raise
    finally:
        watcher.cancel()
        for w in waiters:
            w.cancel()
    stopped = gone.is_set() or revoked.is_set()
    failure: BaseException | None = None
    for sub in subs:
        sub.cancel()   # those still waiting (a cancelled submit aborts what it admitted)
    for c, sub in zip(choices, subs):
        try:
            c.handle = await sub
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # the request's own task, not the one cancelled here
                _abort_all(state, choices, "client disconnected")
                raise
        except Exception as e:  # noqa: BLE001 - the first one is raised below
            failure = failure or e
    if stopped:
        why, error = ("API key revoked", KeyRevoked()) if revoked.is_set() else ("client disconnected", _ClientGone())
        _abort_all(state, choices, why)   # those admitted just as it left
        raise error
    if failure is not None:
        raise failure


async def _encode_chat(tok, messages: list[dict], tools: ToolSpec | None, add_prompt: bool,
                       room: int, max_param: str | None = "max_tokens", cap: int | None = None,
                       continue_final: bool = False) -> list[int]:
    """A chat prompt's ids: generation's and /tokenize's one way to render messages and tools.
    `room`: the most prompt tokens that can fit; a rendered text surely longer is refused
    before it is tokenized (_refuse_surely_too_long). `continue_final`: the text ends inside
    the last (assistant) message, for the answer to go on with it (continued_template)."""
    def encode() -> list[int]:   # rendering the tools too: their schemas may be large
        if continue_final:
            text = continued_template(tok, messages)
        else:
            rendered, template_tools = render_tools(messages, tools, tok.template_has_tools,
                                                    tok.template_has_developer)
            text = tok.apply_chat_template(rendered, add_prompt, template_tools)
        _refuse_surely_too_long(tok, text, room, "messages", max_param, cap)
        return tok.encode_rendered(text)

    try:
        return await asyncio.to_thread(encode)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None


def continued_template(tok, messages: list[dict]) -> str:
    """The chat template's text up to the end of the last message's content, left open: the
    messages rendered with a marker in place of that content, cut at the marker, and the
    content put there as the client sent it (a template that trims or escapes a message's
    text would make a search for the content itself miss, or find it in the markup after it).
    An empty last message leaves nothing to continue: its turn is simply begun."""
    last = messages[-1]
    if not last["content"]:
        rendered, _ = render_tools(messages[:-1], None, tok.template_has_tools, tok.template_has_developer)
        return tok.apply_chat_template(rendered, True)
    marker = f"kvfence-continue-{uuid.uuid4().hex}"   # random: no message can hold it
    rendered, _ = render_tools([*messages[:-1], {**last, "content": marker}], None, tok.template_has_tools,
                               tok.template_has_developer)
    text = tok.apply_chat_template(rendered, False)
    at = text.find(marker)
    if at < 0 or text.find(marker, at + 1) >= 0:
        raise ChatTemplateError("this model's chat template does not write the last assistant message as it is, "
                                "so it cannot be continued; send the text as a /v1/completions prompt")
    return text[:at] + tok.control.mark(last["content"])   # its words as text, as every message's


def _refuse_max_tokens_beyond_context(req: GenerationRequest, usable: int) -> None:
    """A max_tokens that leaves no room for even a one-token prompt is the max_tokens' fault:
    say so under the name the client sent (clients default to 4096 or 8192)."""
    mt = req.params.max_tokens
    if mt is not None and mt >= usable and not faults.active("skip_router_admission"):
        # OpenAI's opening words: clients (LiteLLM) tell a context overflow by them
        left_out = ("the completion may then use whatever the prompt leaves" if req.kind == "chat" else
                    "a completion then has 16 tokens")
        raise APIError(400, f"This model's maximum context length is {usable} tokens, prompt included, and "
                            f"'{req.max_tokens_param}' is {mt}: set it below {usable}, or leave it out ({left_out}).",
                       code="context_length_exceeded", param=req.max_tokens_param, outcome="rejected")


def _limit_implicit_max_tokens(req: GenerationRequest, tenant: Tenant, prompts: list[list[int]], usable: int) -> None:
    """A request that sets no max_tokens may run to the end of the context, and
    tokens_per_minute reserves all of it: a tenant whose limit is below the context could then
    send no such request at all (most clients set none), and every one held the rest of the
    context from its budget. Its limit is the tenant's default_max_tokens, and never more than
    an empty minute of its tokens_per_minute could take; it ends with finish_reason "length"
    there. A request that sets max_tokens is taken as it is."""
    if req.params.max_tokens is not None or not prompts:
        return
    room = min(completion_tokens(None, len(ids), usable) for ids in prompts)
    caps = [room, tenant.limits.default_max_tokens,
            TenantLimiter.largest_max_tokens(tenant, sum(len(ids) for ids in prompts), len(prompts) * req.n)]
    cap = min(c for c in caps if c is not None)
    if cap >= 1 and cap < room:   # below 1 the prompt alone is refused, with its own reason
        req.params = dataclasses.replace(req.params, max_tokens=cap)


def _refuse_more_choices_than_wait(req: GenerationRequest, places: int | None) -> None:
    """A request's choices wait together (the later ones for the first's prompt) and count one
    place each in the engine's queue: with more of them than one tenant may have waiting, its
    503 "retry shortly" came back on every retry (n=16 with --max-waiting 16 behind a tenants
    file). Deliberately a bound without timing: a first choice that happened to start before
    the others queued left one more place, so some such requests were served, some not."""
    wanted = len(req.prompts) * req.n
    if places is not None and wanted > places:
        raise bad_request(f"This request asks for {wanted} choices (prompts x n); this server lets a tenant have "
                          f"{places} requests waiting (--max-waiting), and a request's choices wait together: "
                          f"send at most {places}.", param="prompt" if len(req.prompts) > 1 else "n",
                          code="too_many_choices")


def _refuse_if_too_long(ids: list[int], req: GenerationRequest, usable: int) -> None:
    """I4 here, before any tenant accounting or engine work; the engine checks again."""
    try:
        if not faults.active("skip_router_admission"):
            check_fits(len(ids), _least_completion(req), usable)
    except ContextLengthExceeded as e:
        raise _too_long(e, req) from None


def _least_completion(req: GenerationRequest) -> int:
    """The completion tokens I4 (check_fits) keeps room for beside the prompt: max_tokens, 0
    for echo only, and 1 when unset (the request then takes what the context leaves)."""
    mt = req.params.max_tokens
    return 1 if mt is None else mt


def _prompt_room(state: ServerState, req: GenerationRequest) -> int:
    """The most prompt tokens the context leaves (the pre-tokenizing bound's side of I4)."""
    return state.facts["usable_context"] - _least_completion(req)


def _refuse_surely_too_long(tok, text: str, room: int, param: str, max_param: str | None = "max_tokens",
                            cap: int | None = None) -> None:
    """Tokenizing costs ~1 s of CPU per MiB; a text whose length alone shows it needs more
    tokens than `room` is refused first (a lower bound from the vocabulary's longest token,
    so nothing that fits is ever refused here), or more than the tenant's prompt cap `cap`.
    The exact checks follow tokenizing. `max_param`: the request's completion limit, which
    room leaves space for (None: room is the whole context, /tokenize)."""
    fewest = tok.fewest_tokens(text)
    if cap is not None and fewest > cap:
        raise prompt_cap_refusal(cap, f"this prompt's {len(text)} characters are at least {fewest} tokens", param)
    if fewest > room and not faults.active("skip_router_admission"):
        fit = (f"at most {max(room, 0)} prompt tokens fit beside '{max_param}'. Please shorten '{param}' or lower "
               f"'{max_param}'." if max_param else f"this model's context is {room} tokens.")
        raise APIError(400, f"This model's maximum context length is too small for this prompt: its {len(text)} "
                            f"characters are at least {fewest} tokens, and {fit}",
                       code="context_length_exceeded", param=param, outcome="rejected")


async def _tokenize(state: ServerState, req: GenerationRequest, text: str | None,
                    prompt_ids: list[int] | None, cap: int | None) -> list[int]:
    """`cap`: the tenant's max_prompt_tokens, checked exactly by TenantLimiter.charge; a text
    surely longer is refused before it is tokenized, under its own name."""
    tok = state.engine.tokenizer
    room = _prompt_room(state, req)
    if req.kind == "chat":
        assert req.messages is not None
        ids = await _encode_chat(tok, req.messages, req.tools, True, room, req.max_tokens_param, cap,
                                 continue_final=req.continue_final)
    elif prompt_ids is not None:
        ids = prompt_ids   # checked against the vocabulary after admission (I4): see _generate
    else:
        assert text is not None
        _refuse_surely_too_long(tok, text, room, req.prompt_param, req.max_tokens_param, cap)
        ids = await asyncio.to_thread(tok.encode, text)
    if not ids:
        raise bad_request("The prompt is empty after tokenization.", param=req.prompt_param)
    return ids


def _count_refusal(state: ServerState, tenant: Tenant | None, e: APIError) -> None:
    name = tenant.name if tenant is not None else UNAUTHENTICATED
    state.metrics.requests.labels(name, e.outcome).inc()
    reason = _REJECTION_REASON.get(e.code or "")
    if reason is None and e.status in (400, 413):
        reason = "invalid_request"
    if reason is not None:
        state.metrics.rejections.labels(reason).inc()


# schemas are checked (one at a time: schema_check.py's worker) and built on this thread, not
# in the default pool that tokenizing and body parsing share: checks queued behind a tenant's
# costly schemas, a second each, held every pool thread (found in review). Tenants take turns
# on it: in arrival order, another tenant's schema waited for all of one tenant's costly ones
_SCHEMA_CHECKS = FairWorker("kvfence-schema")
# per server (ServerState.schema_checks_by_tenant, all tenants): as many as the engine lets wait
# by default. Most are a kept verdict and a build of milliseconds, and with tenants taking turns
# a long queue delays only the tenant that made it (64 refused a burst of 100 structured requests)
MAX_QUEUED_SCHEMA_CHECKS = 1024
# one tenant may hold this many (4 refused most of a burst of 16 structured requests whose schema
# was checked long before); a single-tenant server's one tenant may hold them all. A tenant with
# none waiting is let in even past the total, so no set of tenants can shut the others out
MAX_QUEUED_SCHEMA_CHECKS_PER_TENANT = 64
SCHEMA_VERDICTS_KEPT = 1024     # (tenant, schema) verdicts, so a schema sent again skips the worker


# large answers are built here, not in the default pool that tokenizing and body parsing
# share, and small ones on the loop: a tenant whose answers are large (echo and logprobs)
# queues behind large builds only (found in review: every answer went through these two
# threads, so another tenant's 16 echo answers of ~0.6 s each held up a one-line answer)
_ANSWER_BUILDERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfence-answer")
INLINE_ANSWER_ENTRIES = 4096   # logprob entries an answer built on the loop may hold (~2 ms)


async def build_answer(build: Callable[[], dict], cost: int) -> dict:
    """`cost`: what building the answer costs, in logprob entries (~0.5 us each)."""
    if cost <= INLINE_ANSWER_ENTRIES:
        return build()
    return await asyncio.get_running_loop().run_in_executor(_ANSWER_BUILDERS, build)


async def json_answer(answer: dict) -> Response:
    """An answer (built by build_answer: Python code, which lets the loop run) encoded a slice
    at a time (server/json_slices.py). One with ~1M logprob entries (echo, logprobs, n=11 over
    4000 prompt tokens) took ~0.6 s to build and 1.3-2.4 s to encode; on the event loop, or
    encoded in a thread (the C encoder holds the GIL throughout), that paused every other
    tenant's stream and /health/live."""
    return Response(await encode_json(answer), media_type="application/json")


@dataclass
class _Choice:
    """One choice of a request: a prompt (of a completions batch) and a seed stream. Every
    choice is admitted at once; the engine starts the first of each prompt first and the others
    once it has run the prompt's prefill, so that they attach its full KV pages from the
    tenant's prefix cache (shared read-only under the ledger's rules) and compute only the
    partial last page themselves."""
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    lead: bool                         # the first choice of its prompt
    echo: str = ""                     # completions with echo: the prompt's text
    grammar: LLMatcher | None = None   # the request's schema's matcher, built off the engine thread
    # echo with logprobs: the prompt's logprobs, computed by the lead alone (its siblings
    # attach its cached pages instead, and read these)
    prompt_logprobs: list = field(default_factory=list)
    leader: _Choice | None = None      # a sibling's lead
    handle: RequestHandle | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: Update | None = None
    first_token_at: float | None = None
    started_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        return None if self.last is None else self.last.finish_reason

    @property
    def ok(self) -> bool:
        return self.reason in ("stop", "length")

    @property
    def done(self) -> bool:
        """Its last update has been taken from the queue (the handle is done earlier)."""
        return self.last is not None and self.last.finished


def _choices(state: ServerState, req: GenerationRequest, prompts: list[list[int]], rid: str,
             grammar: LLMatcher | None = None) -> list[_Choice]:
    """prompts x n choices, index p * n + j; choice j's seed is seed + j (each its own stream)."""
    out: list[_Choice] = []
    tok = state.engine.tokenizer
    for p, (ids, (text, _)) in enumerate(zip(prompts, req.prompts)):
        echo = (text if text is not None else tok.decode(ids, skip_special_tokens=False)) if req.echo else ""
        lead = None
        for j in range(req.n):
            seed = req.params.seed
            params = req.params if j == 0 or seed is None else dataclasses.replace(
                req.params, seed=(seed + j) if seed + j < 2**64 else seed - j)
            if j > 0 and params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=None)   # the lead's are the same
            index = p * req.n + j
            c = _Choice(index, rid if index == 0 else f"{rid}-{index}", ids, params, j == 0, echo, grammar)
            if lead is None:
                lead = c
            else:
                c.leader = lead
            out.append(c)
    return out


def _tokens_generated(choices: list[_Choice], taken: Iterable[tuple[_Choice, object]] = ()) -> int:
    """Completion tokens the engine made for these choices so far, read or not: each one's last
    update read, those `taken` from its handle and not read, and those still in its handle (what
    it makes until an abort lands is not counted). Called once nothing reads them any more.

    The engine does not wait for a slow reader: a stream whose client stopped reading leaves
    updates queued, and charging only what was read let such a client reserve max_tokens, have
    them all generated, and pay for a few (found in review). And behind the PD router a request's
    first choices generate on decode while a later one waits there for pages, up to its lease:
    refunded whole when that one failed, such requests cost the tenant's tokens_per_minute
    nothing (a review)."""
    latest = {c.index: c.last.completion_tokens if c.last else 0 for c in choices}

    def see(c: _Choice, u) -> None:
        if isinstance(u, Update):
            latest[c.index] = max(latest[c.index], u.completion_tokens)

    for c, u in taken:
        see(c, u)
    for c in choices:
        while c.handle is not None and not c.handle.updates.empty():
            see(c, c.handle.updates.get_nowait())
    return sum(latest.values())


def _abort_all(state: ServerState, choices: list[_Choice], reason: str) -> None:
    """Abort every choice still running. One without a handle too, by its id: its submit may
    have admitted it just as the request was cancelled (abort is idempotent, and an id the
    engine never saw is nothing to it)."""
    for c in choices:
        if c.handle is None or (not c.handle.done and not c.done):
            state.engine.abort(c.rid, reason)


class _Run:
    """One admitted request on the server side, with all its choices: collects their
    updates, streams or returns them, and on every way out (finish, error, disconnect,
    cancellation) aborts what still runs in the engine, releases the tenant's slot and
    records metrics exactly once."""

    def __init__(self, state: ServerState, request: Request, choices: list[_Choice], tenant: Tenant,
                 lease: Lease, arrival: float, req: GenerationRequest, kind: str = "chat"):
        self.state, self.request, self.choices, self.tenant, self.lease = state, request, choices, tenant, lease
        self.arrival, self.req, self.kind = arrival, req, kind   # kind: the route's ("responses": a view of chat)
        tok = state.engine.tokenizer
        ll = ll_tokenizer(tok, state.facts["vocab_size"]) if req.logprobs is not None else None
        self.fmt = Formatter(req.kind, choices[0].rid, state.served_name, state.facts["fingerprint"],
                             lambda tid: tok.decode([tid], skip_special_tokens=False),
                             None if ll is None else lambda tid: ll.decode_bytes([tid]), req.legacy_functions)
        for c in choices:
            if c.echo:
                self.fmt.start_offset(c.index, len(c.echo))
        self.disconnected = False
        self.revoked = False
        self._closed = False
        self._queue: asyncio.Queue = asyncio.Queue()   # (choice, Update | BaseException) from every pump
        self._pumps: list[asyncio.Task] = []

    # -- totals: the prompt counted once per prompt, every choice's completion ------------------
    @property
    def prompt_tokens(self) -> int:
        return sum((c.last.prompt_tokens if c.last else len(c.prompt_ids)) for c in self.choices if c.lead)

    @property
    def completion_tokens(self) -> int:
        return sum(c.last.completion_tokens for c in self.choices if c.last)

    def _tokens_generated(self) -> int:
        """Completion tokens the engine made for this request (module _tokens_generated), once
        the pumps are stopped: those they took and queued here count too."""
        taken = []
        while not self._queue.empty():
            taken.append(self._queue.get_nowait())
        return _tokens_generated(self.choices, taken)

    @property
    def cached_tokens(self) -> int:
        """Of prompt_tokens, those read from the prefix cache: the lead choices', as the prompt is
        counted once (the other choices' attaching its pages is how n is served, not a cache hit
        of the client's)."""
        return sum(c.last.cached_tokens for c in self.choices if c.lead and c.last)

    def _usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _ok(self) -> bool:
        return all(c.ok for c in self.choices)

    def _client_gone(self) -> None:
        self.disconnected = True
        _abort_all(self.state, self.choices, "client disconnected")

    def revoke(self) -> None:
        """Its key was revoked: the engine stops now, and the client's answer (or stream)
        ends with 401 api_key_revoked where it is read next. The pumps stop now too, not when
        the consumer reads on (a stream whose client paused reading may not for long): no more
        of what the engine made before the abort reaches it."""
        self.revoked = True
        for t in self._pumps:
            t.cancel()
        _abort_all(self.state, self.choices, "API key revoked")
        self._queue.put_nowait((self.choices[0], KeyRevoked()))

    # -- the choices' updates ----------------------------------------------------------------------
    def _start(self) -> None:
        for c in self.choices:
            if c.handle is not None:
                self._pumps.append(asyncio.create_task(self._pump(c)))

    async def _pump(self, c: _Choice) -> None:
        assert c.handle is not None
        try:
            while not c.handle.done:
                u = await c.handle.next()
                await self._queue.put((c, u))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the consumer decides what it means
            await self._queue.put((c, e))

    async def _updates(self):
        """(choice, update) until every choice is done; an exception ends the request."""
        if self.revoked:   # revoked before the stream was first read: nothing of it is sent
            raise KeyRevoked()
        self._start()
        while not all(c.done for c in self.choices):
            if self.revoked:   # before what is queued: a client that paused reading gets no more
                raise KeyRevoked()
            c, u = await self._queue.get()
            if isinstance(u, BaseException):
                raise u
            c.last = u
            if u.prompt_logprobs:
                c.prompt_logprobs = list(u.prompt_logprobs)
            c.first_token_at = c.first_token_at or u.first_token_at
            c.started_at = c.started_at or u.started_at
            c.token_times.extend(u.token_times)
            yield c, u
            if u.finished and not c.ok:
                return    # one choice failed: the request fails (close() aborts the rest)

    def close(self, outcome: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._pumps:
            t.cancel()
        if not all(c.done for c in self.choices):
            _abort_all(self.state, self.choices, "API key revoked" if self.revoked else
                       "client disconnected" if not self._ok() else "request ended")
            self.disconnected = self.disconnected or not self._ok()
        if self.revoked and not self._ok():
            outcome = "key_revoked"
        elif outcome is None:
            reason = next((c.reason for c in self.choices if c.reason), None)
            if self._ok():
                outcome = reason or "error"
            elif self.disconnected:
                outcome = "client_disconnected"
            else:   # an abort the client caused (its schema's limits) is no server error; the
                # status alone (_failure would log a node's detail a second time)
                u = self._failed_update()
                client_caused = u is not None and abort_status(u.abort_code)[0] == 400
                outcome = "invalid" if client_caused else "error"
                if not client_caused:   # the code the client is told (_failure)
                    code = "engine_unavailable" if u is None else u.abort_code or "request_aborted"
                    self.state.metrics.failures.labels(code).inc()
        generated = self._tokens_generated()
        self.lease.release(generated)   # the engine's work: what the tenant's minute paid for
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        starts = [c.started_at for c in self.choices if c.started_at is not None]
        # what the client saw: a failed unstreamed answer got it no token (a PD node lost after
        # 21 tokens counted them, and its TTFT, for a client that got a 503)
        if self._ok() or self.req.stream:
            self.state.metrics.finished(self.tenant.name, outcome, self.prompt_tokens, self.completion_tokens,
                                        self.arrival, min(firsts) if firsts else None,
                                        [c.token_times for c in self.choices],   # the updates it read
                                        min(starts) if starts else None)
        else:
            self.state.metrics.finished(self.tenant.name, outcome, self.prompt_tokens)
        ttft = round((min(firsts) - self.arrival) * 1e3, 1) if firsts else None
        # counts only: never prompt or completion text
        log.info("%s tenant=%s choices=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d outcome=%s "
                 "ttft_ms=%s", self.choices[0].rid, self.tenant.name, len(self.choices), self.prompt_tokens,
                 self.completion_tokens, self.cached_tokens, outcome, ttft)

    def _failed_update(self) -> Update | None:
        """The last update of the first choice that ended without its answer (None: the engine
        stopped before any choice ended)."""
        bad = next((c for c in self.choices if c.last is not None and c.last.finished and not c.ok), None)
        return bad.last if bad is not None else None

    def _failure(self) -> APIError:
        u = self._failed_update()
        if u is None:
            return APIError(503, "The engine stopped before the request finished.", code="engine_unavailable")
        status, what = abort_status(u.abort_code)
        detail = str(u.error or u.finish_reason)
        if u.abort_code == "isolation_violation":
            # which check failed, not its detail: that names another owner's request, scope and
            # epoch (found in review); the server's log and incident log keep it
            detail = f"{detail.split(':', 1)[0]} (details in the server's incident log)"
        else:
            detail = _public_detail(self.state, self.choices[0].rid, self.tenant, u.abort_code, detail)
        param = None
        if u.abort_code == "grammar_limit_exceeded":   # the client's schema: where it wrote it
            tools = self.req.tools
            param = "tools" if tools is not None and tools.enforced else "response_format"
        err = APIError(status, f"{what}: {detail}.", code=u.abort_code or "request_aborted", param=param)
        return responses_api.refused(err) if self.kind == "responses" else err   # its own field names

    def _fail_on(self, e: BaseException) -> APIError:
        if isinstance(e, KeyRevoked):
            return e.api_error()
        if isinstance(e, EngineFailed):
            detail = _public_detail(self.state, self.choices[0].rid, self.tenant, e.code, str(e))
            # a request already taken: the server failed it (not a 503 before admission)
            if e.code == "server_shutting_down":   # another choice of it came after the deadline
                return APIError(503, f"{ABORT_STATUS[e.code][1]}: {detail}.", code=e.code, outcome="error")
            return APIError(503, f"The engine stopped serving this request: {detail}.", code="engine_unavailable",
                            outcome="error")
        if isinstance(e, Overloaded):
            return APIError(503, str(e), code="server_overloaded", headers={"Retry-After": str(e.retry_after_s)},
                            outcome="overloaded")
        if isinstance(e, (ValueError, ContextLengthExceeded)):
            return APIError(400, str(e), code="invalid_request")
        raise e

    def _end_on(self, e: Exception) -> APIError:
        """The client's error for an exception that ended the request, which is closed with the
        outcome that error is (a server failure also counted by its code, as close() counts the
        ones it finds: an engine that stopped was counted as a plain error, a later choice
        refused for load as one too, and neither in kvfence_request_failures_total). An exception
        with no client error (a bug) closes it as an error, uncounted by code, and goes on up."""
        try:
            err = self._fail_on(e)
        except BaseException:
            self.close("error")
            raise
        self.close(err.outcome)
        if err.outcome == "error":
            self.state.metrics.failures.labels(err.code or "request_aborted").inc()
        return err

    async def collect(self) -> Response:
        return await json_answer(await self.result())

    async def result(self) -> dict:
        """The whole answer's body (chat.completion or text_completion); APIError if it failed."""
        watcher = asyncio.create_task(watch_disconnect(self.request, self._client_gone))
        try:
            async for c, u in self._updates():
                c.text.append(u.text)
                c.logprobs.extend(u.logprobs)
        except Exception as e:  # noqa: BLE001 - mapped to the client's error below
            raise self._end_on(e) from None
        finally:
            watcher.cancel()
        if not self._ok():
            self.close()
            raise self._failure()
        self.close()
        return await build_answer(self._body, self._build_cost())   # see json_answer

    def _top(self) -> int:
        p = self.req.params
        return max(p.logprobs or 0, p.prompt_logprobs or 0) + 1

    def _build_cost(self) -> int:
        """What building the whole answer costs, in logprob entries: those it holds, and with
        tools its text, which the calls are parsed from (~0.2 us a character, and _cut_calls
        scans a cut call in Python: found in review, an answer of 16 choices of 8K tokens
        would have been parsed on the loop for ~100 ms)."""
        entries = self._top() * sum(len(c.logprobs) + (len(c.prompt_ids) if self._scores_prompt else 0)
                                    for c in self.choices)
        if self.req.tools is not None and self.req.tools.active:
            entries += sum(len(c.echo) + sum(map(len, c.text)) for c in self.choices) // 2
        return entries

    def _body(self) -> dict:
        want = self.req.logprobs is not None
        out = []
        for c in self.choices:
            self._prompt_logprobs(c)
            content, calls = self._answer(c, c.echo + "".join(c.text))
            cut = self._enforced and not enforced_answer_whole("".join(c.text))
            out.append((content, finish_reason(c.reason, bool(calls), cut), c.logprobs if want else None, calls))
        return self.fmt.response(out, self._usage())

    @property
    def _scores_prompt(self) -> bool:
        """Completions with echo and logprobs: the prompt's tokens come with their logprobs."""
        return self.req.params.prompt_logprobs is not None

    def _echo_chunk(self, c: _Choice, inc: bool) -> dict:
        """A streamed choice's first chunk with echo and logprobs: the prompt and its logprobs."""
        self._prompt_logprobs(c)
        return self.fmt.chunk(c.echo, None, [], inc, index=c.index)

    def _prompt_logprobs(self, c: _Choice) -> None:
        if self._scores_prompt:
            lead = c.leader or c
            self.fmt.prompt_logprobs(c.index, c.prompt_ids[0], lead.prompt_logprobs)

    @staticmethod
    def _take_logprobs(c: _Choice, want: bool) -> list | None:
        """A streamed tool answer's logprobs not sent yet (all of them together add up to the
        unstreamed answer's), or None when the request did not ask for logprobs."""
        if not want:
            return None
        out, c.logprobs = c.logprobs, []
        return out

    @property
    def _enforced(self) -> bool:
        return self.req.tools is not None and self.req.tools.enforced

    def _answer(self, c: _Choice, text: str) -> tuple[str | None, list[dict] | None]:
        """A finished choice's content and tool calls (kvfence/server/tools.py)."""
        spec = self.req.tools
        if spec is None or not spec.active:
            return text, None
        return parse_answer(text, spec)

    async def events(self):
        chunks = self.chunks()
        try:
            async for x in chunks:
                yield sse(x)
        finally:
            await chunks.aclose()   # its disconnect watcher stops now, not when collected

    async def chunks(self):
        """The stream's bodies in order: chunks, an error body if it fails, then "[DONE]"."""
        want_lps = self.req.logprobs is not None
        inc = self.req.include_usage
        # an enforced answer (required, a named function) is calls by construction: they are
        # streamed as generated. An auto one streams its text until a <tool_call> tag begins
        # (TextBeforeCalls), the rest once it is whole; one that may be a bare JSON call (with
        # a response_format) is sent whole at its end
        tools = self.req.tools is not None and self.req.tools.active
        enforced = tools and self._enforced
        streams_text = tools and not enforced and self.req.tools is not None and self.req.tools.answer_schema is None
        watcher = asyncio.create_task(watch_disconnect(self.request, self._client_gone))
        try:
            for c in self.choices:
                if self.req.kind == "chat":   # the role; no token yet, so logprobs null (as OpenAI's)
                    # with tools the answer may be calls: no content yet, as OpenAI's first delta of
                    # a tool-call answer says, so a client assembles null for calls, not "" (text,
                    # when it comes, fills it)
                    yield self.fmt.chunk(None if tools else "", None, None, inc, first=True, index=c.index)
                elif c.echo and not self._scores_prompt:   # else once its logprobs are known
                    yield self.fmt.chunk(c.echo, None, None, inc, index=c.index)
            echoed: set[int] = set()
            calls: dict[int, CallStream] = {}
            texts: dict[int, TextBeforeCalls] = {}
            try:
                async for c, u in self._updates():
                    if self._scores_prompt and c.index not in echoed and (c.ok or not u.finished):
                        echoed.add(c.index)
                        # built and encoded as the unstreamed answer is: ~3K prompt tokens with 20
                        # top logprobs each held the loop ~90 ms a choice, 16 choices a request
                        echo = await build_answer(functools.partial(self._echo_chunk, c, inc),
                                                  self._top() * len(c.prompt_ids))   # this choice's
                        yield (await encode_json(echo)).decode()
                    if enforced:   # logprobs go with the call deltas their tokens made, or wait for the next
                        c.text.append(u.text)
                        c.logprobs.extend(u.logprobs)
                        deltas = calls.setdefault(c.index, CallStream()).feed(u.text)
                        if deltas:
                            yield self.fmt.chunk("", None, self._take_logprobs(c, want_lps), inc, index=c.index,
                                                 call_deltas=deltas)
                    elif tools:
                        c.text.append(u.text)
                        c.logprobs.extend(u.logprobs)
                        if streams_text and (piece := texts.setdefault(c.index, TextBeforeCalls()).feed(u.text)):
                            yield self.fmt.chunk(piece, None, self._take_logprobs(c, want_lps), inc, index=c.index)
                    elif u.text or (want_lps and u.logprobs):
                        yield self.fmt.chunk(u.text, None, list(u.logprobs) if want_lps else None, inc,
                                             index=c.index)
                    if u.finished and c.ok and enforced:
                        text = "".join(c.text)
                        named = bool(calls[c.index].calls)   # else cut before a name closed: as unstreamed
                        spec = self.req.tools
                        if not named and spec is not None and \
                                (only := call_cut_before_its_name(text, spec)) is not None:
                            named = True
                            yield self.fmt.chunk("", None, self._take_logprobs(c, want_lps), inc,
                                                 index=c.index, call_deltas=[{"index": 0, **only}])
                        yield self.fmt.chunk("", finish_reason(c.reason, named, not enforced_answer_whole(text)),
                                             self._take_logprobs(c, want_lps) or None, inc, index=c.index)
                    elif u.finished and c.ok and tools:
                        content, whole = self._answer(c, "".join(c.text))
                        left = texts[c.index].rest(content) if c.index in texts else content or ""
                        yield self.fmt.chunk(left, None, self._take_logprobs(c, want_lps), inc,
                                             index=c.index, tool_calls=whole)
                        yield self.fmt.chunk("", finish_reason(c.reason, bool(whole), False), None, inc,
                                             index=c.index)
                    elif u.finished and c.ok:
                        yield self.fmt.chunk("", c.reason, None, inc, index=c.index)
            except Exception as e:  # noqa: BLE001 - the stream ends with the error
                yield self._end_on(e).body()
                return
            if not self._ok():
                yield self._failure().body()
                yield "[DONE]"
                return
            if inc:
                yield self.fmt.usage_chunk(self._usage())
            yield "[DONE]"
        finally:
            watcher.cancel()
