"""The OpenAI-compatible HTTP API: routes, and the life of one request on the server side.

auth (tenant from the API key) -> ready? -> body -> model -> tokenize -> admission against
the usable context (I4; the engine checks again) -> tenant limits -> engine, then stream or
collect, with a client disconnect turned into an engine abort that gives the pages back.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded, Overloaded, check_fits
from kvfence.engine.grammar import GrammarError, check_schema, ll_tokenizer
from kvfence.model.tokenizer import ChatTemplateError
from kvfence.server.backend import EngineBackend, EngineFailed, RequestHandle, Update
from kvfence.server.disconnect import watch_disconnect
from kvfence.server.errors import ABORT_STATUS, APIError, bad_request, error_body
from kvfence.server.isolation import isolation_statement
from kvfence.server.metrics import CONTENT_TYPE, ServerMetrics
from kvfence.server.openai_format import Formatter, sse, usage
from kvfence.server.protocol import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    read_json_body,
)
from kvfence.server.tenants import Lease, Tenant, TenantLimiter, TenantRegistry

log = logging.getLogger("kvfence.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20
UNAUTHENTICATED = "unauthenticated"


class ServerState:
    def __init__(self, engine: EngineBackend, tenants: TenantRegistry, served_model_name: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, owns_engine: bool = True, public_api: bool = True):
        self.engine = engine
        # False on a PD node without a tenants file: no /v1 generation or model routes, so
        # nothing reaches its engine around the router's admission and tenant limits
        self.public_api = public_api
        self.tenants = tenants
        self.limiter = TenantLimiter()
        self.metrics = ServerMetrics(engine)
        self.max_body_bytes = max_body_bytes
        self.owns_engine = owns_engine
        self._served = served_model_name

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
            raise APIError(503, "The model is still loading; try again shortly.", code="model_not_ready",
                           headers={"Retry-After": "5"})
        raise APIError(503, f"The engine is not serving ({st}): {self.engine.error or 'stopped'}.",
                       code="engine_unavailable")

    @property
    def facts(self) -> dict:
        """The backend's static facts; they exist once it is ready (503 before)."""
        f = self.engine.facts
        if f is None:
            raise APIError(503, "The model is still loading; try again shortly.", code="model_not_ready",
                           headers={"Retry-After": "5"})
        return f

    def statement(self) -> dict:
        return isolation_statement(self.facts, self.engine.startup_checks, self.tenants,
                                   self.engine.snapshot, self.served_name)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            if state.owns_engine:
                await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="kvfence", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvfence = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = f"No route {request.method} {request.url.path}." if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(error_body(msg, type_, None, None), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.error("unhandled %s on %s %s", type(e).__name__, request.method, request.url.path)
        return JSONResponse(error_body("Internal server error.", "server_error", None, None), status_code=500)

    # -- operational endpoints -------------------------------------------------------------
    @app.get("/health")
    async def health():
        st = state.engine.state
        snap = state.engine.snapshot
        body = {"status": "ok" if st == "ready" else st, "ready": st == "ready", "alive": st in ("ready", "loading"),
                "running": snap.get("running"), "waiting": snap.get("waiting")}
        if state.engine.error:
            body["error"] = state.engine.error
        return JSONResponse(body, status_code=200 if st == "ready" else 503)

    @app.get("/health/live")
    async def live():
        st = state.engine.state
        alive = st in ("ready", "loading")
        return JSONResponse({"alive": alive, "status": st}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # -- OpenAI API ------------------------------------------------------------------------
    if state.public_api:
        _openai_routes(app, state)

    @app.get("/v1/kvfence/isolation")
    async def isolation(request: Request):
        state.tenants.authenticate(request.headers.get("authorization"))
        state.ensure_ready()
        return state.statement()

    return app


def _openai_routes(app: FastAPI, state: ServerState) -> None:
    """The public OpenAI API: models, completions, chat completions."""
    @app.get("/v1/models")
    async def models(request: Request):
        state.tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(state)] if state.engine.facts else []}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        state.tenants.authenticate(request.headers.get("authorization"))
        if not state.engine.facts or model != state.served_name:
            raise APIError(404, f"The model '{model}' does not exist.", code="model_not_found", param="model")
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, "completion")

    # vLLM's extension routes, for clients that count tokens before they send: the same key
    # as generation, the same tokenizer and chat template, nothing reaches the engine
    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.tenants.authenticate(request.headers.get("authorization"))
        state.ensure_ready()
        body = await read_json_body(request, state.max_body_bytes)
        text, messages, add_prompt = parse_tokenize(body)
        tok = state.engine.tokenizer
        try:
            ids = await asyncio.to_thread(tok.encode_chat, messages, add_prompt) if messages is not None else \
                await asyncio.to_thread(tok.encode, text)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": state.facts["usable_context"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.tenants.authenticate(request.headers.get("authorization"))
        state.ensure_ready()
        ids = parse_detokenize(await read_json_body(request, state.max_body_bytes))
        vocab = state.facts["vocab_size"]
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"Token ids must be in [0, {vocab}).", param="tokens")
        text = await asyncio.to_thread(state.engine.tokenizer.decode, ids, False)
        return {"prompt": text}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, "chat")


def _model_card(state: ServerState) -> dict:
    f = state.facts
    return {"id": state.served_name, "object": "model", "created": 0, "owned_by": "kvfence",
            "max_model_len": f["usable_context"], "fingerprint": f["fingerprint"]}


_REJECTION_REASON = {"context_length_exceeded": "context_length_exceeded",
                     "tenant_max_prompt_tokens": "tenant_max_prompt_tokens",
                     "tenant_max_concurrent_requests": "tenant_max_concurrent_requests",
                     "tenant_tokens_per_minute": "tenant_tokens_per_minute",
                     "invalid_api_key": "unauthorized", "model_not_found": "model_not_found",
                     "model_not_ready": "not_ready", "engine_unavailable": "not_ready",
                     "server_overloaded": "server_overloaded"}




async def _generate(state: ServerState, request: Request, kind: str):
    arrival = time.perf_counter()
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    tenant: Tenant | None = None
    lease: Lease | None = None
    try:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        state.ensure_ready()
        body = await read_json_body(request, state.max_body_bytes)
        parse = parse_completion if kind == "completion" else parse_chat
        # a long token-id prompt or conversation is validated off the event loop, like its JSON
        big = any(isinstance(v, list) and len(v) > 4096 for v in (body.get("prompt"), body.get("messages")))
        req = await asyncio.to_thread(parse, body) if big else parse(body)
        if req.model is not None and req.model != state.served_name:
            raise APIError(404, f"The model '{req.model}' does not exist.", code="model_not_found", param="model")
        ids = await _tokenize(state, req)
        facts = state.facts
        try:  # I4 here, before any tenant accounting or engine work; the engine checks again
            if not faults.active("skip_router_admission"):
                check_fits(len(ids), req.params.max_tokens or 1, facts["usable_context"])
        except ContextLengthExceeded as e:
            raise _too_long(e, req) from None
        if req.prompt_ids is not None:   # after I4: an over-length id list is refused before any per-id work
            vocab = facts["vocab_size"]
            if any(t < 0 or t >= vocab for t in ids):
                raise bad_request(f"Prompt token ids must be in [0, {vocab}).", param="prompt")
        bad_bias = [t for t in req.params.logit_bias if t >= facts["vocab_size"]]
        if bad_bias:
            raise bad_request(f"'logit_bias' names token {bad_bias[0]}, outside the vocabulary "
                              f"[0, {facts['vocab_size']}).", param="logit_bias")
        if req.params.json_schema is not None:
            await _check_schema(state, str(req.params.json_schema))
        # tokens_per_minute reserves the most this request can use: prompt + max_tokens, or the
        # rest of the context when it sets none (what the engine will allow); refunded at the end
        most = req.params.max_tokens or max(1, facts["usable_context"] - len(ids))
        lease = state.limiter.admit(tenant, len(ids), most)
        try:
            handle = await _submit_unless_gone(state, request, ids, req, tenant, rid)
        except _ClientGone:
            lease.release()
            state.metrics.finished(tenant.name, "client_disconnected")
            return Response(status_code=499)  # nobody is listening; the request never started
        except ContextLengthExceeded as e:
            raise _too_long(e, req) from None
        except Overloaded as e:
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": str(e.retry_after_s)},
                           outcome="overloaded") from None
        except EngineFailed as e:  # the PD router's failures carry a machine-readable code
            headers = {"Retry-After": "1"} if e.code == "server_overloaded" else None
            raise APIError(ABORT_STATUS.get(e.code, (503,))[0], str(e), code=e.code, headers=headers) from None
        except GrammarError as e:
            raise bad_request(str(e), param="response_format") from None
        except ValueError as e:
            raise bad_request(str(e), param=req.prompt_param) from None
    except APIError as e:
        if lease is not None:
            lease.release()
        _count_refusal(state, tenant, e)
        if e.status >= 500 or e.status == 429:
            log.info("%s tenant=%s refused: %s %s", rid, tenant.name if tenant else UNAUTHENTICATED, e.status, e.code)
        return e.response()
    run = _Run(state, request, handle, tenant, lease, arrival, req)
    if req.stream:
        return _EventStream(run.events(), run.close)
    return await run.collect()


async def _check_schema(state: ServerState, schema_json: str) -> None:
    """A 400 that names what llguidance cannot compile, before anything reaches an engine (on
    every role: in PD mode decode compiles it again only after prefill has run). Off the event
    loop: a large schema takes milliseconds."""
    def check() -> str | None:
        return check_schema(ll_tokenizer(state.engine.tokenizer, state.facts["vocab_size"]), schema_json)

    err = await asyncio.to_thread(check)
    if err is not None:
        raise bad_request(f"'response_format' has a schema this server cannot enforce: {err}",
                          param="response_format")


def _too_long(e: ContextLengthExceeded, req: GenerationRequest) -> APIError:
    return APIError(400, str(e), code="context_length_exceeded", param=req.prompt_param, outcome="rejected")


class _ClientGone(Exception):
    pass


async def _submit_unless_gone(state: ServerState, request: Request, ids, req: GenerationRequest, tenant: Tenant,
                              rid: str) -> RequestHandle:
    """engine.submit, abandoned (and so aborted) if the client leaves while it waits. On a
    single node submit is only admission; behind the PD router it lasts the whole prefill."""
    sub = asyncio.ensure_future(state.engine.submit(ids, req.params, tenant.name, rid, tenant.public_prefix_scope))
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(request, gone.set))
    waiter = asyncio.create_task(gone.wait())
    try:
        await asyncio.wait({sub, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        waiter.cancel()
    if sub.done():
        return sub.result()
    sub.cancel()
    try:
        handle = await sub
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to report to
        raise _ClientGone() from None
    state.engine.abort(handle.request_id, "client disconnected")  # admitted just as it left
    raise _ClientGone()


async def _tokenize(state: ServerState, req: GenerationRequest) -> list[int]:
    tok = state.engine.tokenizer
    if req.kind == "chat":
        try:
            ids = await asyncio.to_thread(tok.encode_chat, req.messages)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
    elif req.prompt_ids is not None:
        ids = req.prompt_ids   # checked against the vocabulary after admission (I4): see _generate
    else:
        ids = await asyncio.to_thread(tok.encode, req.prompt_text)
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


class _Run:
    """One admitted request on the server side: collects its updates, streams or returns them,
    and on every way out (finish, error, disconnect, cancellation) aborts it in the engine if
    it is still running, releases the tenant's slot and records metrics exactly once."""

    def __init__(self, state: ServerState, request: Request, handle: RequestHandle, tenant: Tenant,
                 lease: Lease, arrival: float, req: GenerationRequest):
        self.state, self.request, self.handle, self.tenant, self.lease = state, request, handle, tenant, lease
        self.arrival, self.req = arrival, req
        tok = state.engine.tokenizer
        self.fmt = Formatter(req.kind, handle.request_id, state.served_name, state.facts["fingerprint"],
                             lambda tid: tok.decode([tid], skip_special_tokens=False))
        self.prompt_tokens = handle.admission.prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self.last: Update | None = None
        self.disconnected = False
        self._closed = False

    def _client_gone(self) -> None:
        self.disconnected = True
        self.state.engine.abort(self.handle.request_id, "client disconnected")

    def _absorb(self, u: Update) -> None:
        self.last = u
        self.completion_tokens = u.completion_tokens
        self.cached_tokens = u.cached_tokens
        self.prompt_tokens = u.prompt_tokens
        if self.first_token_at is None:
            self.first_token_at = u.first_token_at
        self.token_times.extend(u.token_times)

    def _usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @property
    def _reason(self) -> str | None:
        return None if self.last is None else self.last.finish_reason

    def _ok(self) -> bool:
        return self._reason in ("stop", "length")

    def close(self, outcome: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.handle.done:
            self.state.engine.abort(self.handle.request_id, "client disconnected")
            self.disconnected = True
        if outcome is None:
            outcome = ("client_disconnected" if self.disconnected and not self._ok() else
                       self._reason or "error" if self._ok() else "error")
        self.lease.release(self.completion_tokens)
        self.state.metrics.finished(self.tenant.name, outcome, self.prompt_tokens, self.completion_tokens,
                                    self.arrival, self.first_token_at, self.token_times)
        ttft = None if self.first_token_at is None else round((self.first_token_at - self.arrival) * 1e3, 1)
        # counts only: never prompt or completion text
        log.info("%s tenant=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d outcome=%s ttft_ms=%s",
                 self.handle.request_id, self.tenant.name, self.prompt_tokens, self.completion_tokens,
                 self.cached_tokens, outcome, ttft)

    def _failure(self) -> APIError:
        u = self.last
        if u is None:
            return APIError(503, "The engine stopped before the request finished.", code="engine_unavailable")
        status, what = ABORT_STATUS.get(u.abort_code or "", (500, "The request was aborted"))
        return APIError(status, f"{what}: {u.error or u.finish_reason}.", code=u.abort_code or "request_aborted")

    async def collect(self) -> Response:
        watcher = asyncio.create_task(watch_disconnect(self.request, self._client_gone))
        text: list[str] = []
        lps: list = []
        try:
            while not self.handle.done:
                u = await self.handle.next()
                self._absorb(u)
                text.append(u.text)
                lps.extend(u.logprobs)
        except EngineFailed as e:
            self.close("error")
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            watcher.cancel()
            if not self._closed and not self.handle.done:
                self.close()
        if not self._ok():
            self.close()
            raise self._failure()
        self.close()
        return JSONResponse(self.fmt.response("".join(text), self._reason or "stop",
                                              lps if self.req.logprobs is not None else None, self._usage()))

    async def events(self):
        want_lps = self.req.logprobs is not None
        inc = self.req.include_usage
        watcher = asyncio.create_task(watch_disconnect(self.request, self._client_gone))
        try:
            if self.req.kind == "chat":
                yield sse(self.fmt.chunk("", None, [] if want_lps else None, inc, first=True))
            while not self.handle.done:
                try:
                    u = await self.handle.next()
                except EngineFailed as e:
                    yield sse(APIError(503, str(e), code="engine_unavailable").body())
                    return
                self._absorb(u)
                if u.text or (want_lps and u.logprobs):
                    yield sse(self.fmt.chunk(u.text, None, list(u.logprobs) if want_lps else None, inc))
            if not self._ok():
                yield sse(self._failure().body())
                yield sse("[DONE]")
                return
            yield sse(self.fmt.chunk("", self._reason, None, inc))
            if inc:
                yield sse(self.fmt.usage_chunk(self._usage()))
            yield sse("[DONE]")
        finally:
            watcher.cancel()


class _EventStream(StreamingResponse):
    """Server-sent events whose cleanup runs however the response ends, even if the
    client left before the body iterator started."""

    def __init__(self, events, cleanup):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
