"""A PD node process: `kvfence serve --role prefill|decode`.

The node is a normal kvfence server (same engine thread, /health, /metrics, isolation
statement) whose engine has a KV link attached, plus the internal routes the router uses:

  GET  /internal/info      what the router's capacity check (I8) needs, and the boot id
  POST /internal/prefill   prefill: admit, compute, hold; NDJSON: admitted, then kv_held | failed
  POST /internal/release   prefill: decode verified the transfer (the ACK)
  POST /internal/abort     prefill: end a request; reader_stopped says no pull can be running
  POST /internal/decode    decode: admit, reserve, pull, verify, generate; NDJSON updates

A router that disconnects from a prefill or decode stream aborts that request on the node.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded
from kvfence.engine.config import EngineConfig
from kvfence.pd.manifest import ManifestError
from kvfence.pd.settings import PDSettings
from kvfence.pd.wire import CLUSTER_TOKEN_HEADER, cluster_token, line, params_from_json
from kvfence.server.app import _watch_disconnect
from kvfence.server.engine_loop import EngineFailed, EngineLoop
from kvfence.server.errors import error_body

log = logging.getLogger("kvfence.pd.node")

HEARTBEAT_S = 1.0


def build_node_engine(config: EngineConfig, settings: PDSettings, loaded=None):
    """Runs in the engine thread: the engine, then its KV link on a Mooncake transport."""
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.pd.decode import KvImporter
    from kvfence.pd.prefill import KvExporter
    from kvfence.pd.transfer import PageTransport

    engine = LLMEngine(config, loaded)
    transport = PageTransport(settings.transfer_host, settings.transfer_timeout_s)
    link = (KvExporter if settings.role == "prefill" else KvImporter)(engine, settings, transport)
    log.info("%s node: transfer engine %s, transfer buffer %d rows x %d bytes; lease %.0f s, fence after "
             "deadline + %.0f s", settings.role, transport.session_id, link.staging.capacity_pages,
             link.staging.slot_bytes, settings.lease_s, settings.max_pull_s + settings.clock_skew_s)
    return engine


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code),
                        status_code=status)


def add_internal_routes(app: FastAPI, loop: EngineLoop, settings: PDSettings) -> None:
    secret = cluster_token()

    @app.middleware("http")
    async def _cluster_only(request: Request, call_next):
        if request.url.path.startswith("/internal/") and secret is not None:
            if not hmac.compare_digest(request.headers.get(CLUSTER_TOKEN_HEADER, ""), secret):
                return _error(401, "internal API: missing or wrong cluster token", "unauthorized")
        return await call_next(request)

    @app.get("/internal/info")
    async def info():
        if loop.state != "ready":
            return _error(503, f"node is {loop.state}: {loop.error or ''}", "not_ready")
        return {**loop.facts, "snapshot": loop.snapshot}

    def _parse(body: dict):
        """The request's fields, or a 400 for a malformed internal request (nothing admitted)."""
        try:
            return [int(t) for t in body["prompt_ids"]], params_from_json(body["params"]), None
        except (KeyError, TypeError, ValueError) as e:
            return None, None, _error(400, f"bad internal request: {e}", "invalid_request")

    def _refusal(e: Exception) -> dict:
        if isinstance(e, ContextLengthExceeded):
            return {"event": "rejected", "code": "context_length_exceeded", "message": str(e)}
        if isinstance(e, ManifestError):
            return {"event": "rejected", "code": "kv_manifest_invalid", "message": f"refused the KV handoff: {e}"}
        if isinstance(e, EngineFailed):
            return {"event": "rejected", "code": "engine_unavailable", "message": str(e)}
        return {"event": "rejected", "code": "invalid_request", "message": f"bad internal request: {e}"}

    def _stream(body: dict, ids, params, request: Request, **extra) -> StreamingResponse:
        """Answer at once and admit inside the stream: the router then hears a heartbeat
        every second from the start, so a node busy with a long step is not taken for a
        hung one. First line: admitted or rejected; then updates; the router hanging up
        aborts the request here."""
        rid = body["request_id"]

        async def gen():
            sub = asyncio.ensure_future(loop.submit(ids, params, body["tenant"], rid,
                                                    body.get("public_prefix_scope"), **extra))
            # watch for the router hanging up explicitly (writes to a closed connection do not
            # fail reliably)
            watcher = asyncio.create_task(_watch_disconnect(request, lambda: loop.abort(rid, "router disconnected")))
            handle = None
            try:
                while not sub.done():
                    done, _ = await asyncio.wait({sub}, timeout=HEARTBEAT_S)
                    if not done:
                        yield line({"event": "wait"})
                try:
                    handle = sub.result()
                except (ContextLengthExceeded, ManifestError, EngineFailed, ValueError) as e:
                    yield line(_refusal(e))
                    return
                a = handle.admitted
                yield line({"event": "admitted", "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens})
                while not handle.done:
                    try:  # a heartbeat each second: the router tells a slow node from a hung one
                        u = await asyncio.wait_for(handle.next(), HEARTBEAT_S)
                    except asyncio.TimeoutError:
                        yield line({"event": "wait"})
                        continue
                    yield line({"event": u.event or ("finished" if u.finished else "tokens"),
                                "token_ids": list(u.token_ids), "text": u.text, "finished": u.finished,
                                "finish_reason": u.finish_reason, "error": u.error, "abort_code": u.abort_code,
                                "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                "cached_tokens": u.cached_tokens, "data": u.data,
                                "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                                             for lp in u.logprobs]})
            except EngineFailed as e:
                yield line({"event": "failed", "finished": True, "error": str(e), "abort_code": "engine_failed"})
            finally:
                watcher.cancel()
                if handle is None and not sub.done():
                    sub.cancel()  # still waiting for admission: EngineLoop.submit aborts it
                elif handle is not None and not handle.done:  # the router went away: abort it here too
                    loop.abort(rid, "router disconnected")
        return StreamingResponse(gen(), media_type="application/x-ndjson")

    if settings.role == "prefill":
        @app.post("/internal/prefill")
        async def prefill(request: Request):
            body = await request.json()
            ids, params, err = _parse(body)
            return err or _stream(body, ids, params, request, hold_kv=True)

        @app.post("/internal/release")
        async def release(request: Request):
            rid = (await request.json())["request_id"]
            return {"result": await loop.call(lambda e: e.release_kv(rid))}

        @app.post("/internal/abort")
        async def abort(request: Request):
            body = await request.json()
            rid, stopped = body["request_id"], bool(body.get("reader_stopped", False))
            reason = str(body.get("reason", "aborted by the router"))
            loop.abort(rid, reason)  # still computing: the ordinary abort
            return {"result": await loop.call(lambda e: e.abort_kv(rid, stopped, reason))}
    else:
        @app.post("/internal/decode")
        async def decode(request: Request):
            body = await request.json()
            ids, params, err = _parse(body)
            manifest = body.get("manifest")
            return err or _stream(body, ids, params, request, **({"kv_source": manifest} if manifest is not None else {}))


def serve_node(config: EngineConfig, settings: PDSettings, host: str, port: int, tenants_file: str | None = None,
               log_level: str = "info") -> int:
    import uvicorn

    from kvfence.server import fault_control
    from kvfence.server.app import ServerState, create_app
    from kvfence.server.isolation import run_startup_checks
    from kvfence.server.serve import load_tenants

    if settings.role == "decode":
        config.enable_prefix_cache = False  # decode's KV arrives by transfer; nothing to reuse
    tenants = load_tenants(tenants_file)

    loop = EngineLoop(lambda: build_node_engine(config, settings), run_startup_checks,
                      name=f"kvfence-{settings.role}").start()
    if not loop.wait_ready():
        log.error("%s node not serving: %s", settings.role, loop.error)
        return 2
    state = ServerState(loop, tenants)
    app = create_app(state)
    add_internal_routes(app, loop, settings)
    faults.announce(log)
    fault_control.mount(app)
    log.info("%s node serving its internal API on http://%s:%d/internal", settings.role, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    return 0
