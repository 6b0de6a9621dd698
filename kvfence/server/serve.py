"""`kvfence serve`: load the engine in its own thread, run the start-up checks, then serve HTTP."""
from __future__ import annotations

import dataclasses
import logging
import ssl
import threading

from kvfence.engine.config import EngineConfig
from kvfence.server.app import DEFAULT_MAX_BODY_BYTES, ServerState, create_app
from kvfence.server.engine_loop import EngineLoop
from kvfence.server.http_limits import HttpLimits, port_unavailable, uvicorn_server
from kvfence.server.isolation import run_startup_checks
from kvfence.server.shutdown import BACKSTOP_S, DEFAULT_SHUTDOWN_TIMEOUT_S, GracefulStop
from kvfence.server.tenants import TenantRegistry

log = logging.getLogger("kvfence.server")


def load_tenants(path: str | None, node: bool = False) -> TenantRegistry:
    """The tenants file's registry, said in the log. `node`: a PD node, which serves no /v1 (the
    router checks the keys): the file keys its status routes only."""
    if path is None:
        reg = TenantRegistry.single()
        if node:
            log.warning("no tenants file: this node's status routes (/metrics, /health's detail, the whole isolation "
                        "statement) answer whoever reaches its port; its internal API needs the cluster credential")
        else:
            log.warning("no tenants file: SINGLE-TENANT mode; every request is tenant 'default' and API keys are "
                        "not checked (pass --tenants FILE to serve several tenants)")
    else:
        reg = TenantRegistry.from_file(path)
        # what the operator keys open, said at start: without them the console and the reload
        # route are off and /metrics answers 401 to every scraper
        log.info("%s: %d tenant(s) from %s; %s; operator console and reload route %s; /metrics %s",
                 "tenants file" if node else "multi-tenant mode", len(reg.tenants), path,
                 "a node serves no /v1 (the router checks the keys): the file keys its status routes" if node else
                 "requests need 'Authorization: Bearer <key>'",
                 "on ([operator] key)" if reg.operator_digests else "off (no [operator] key)",
                 "for the [metrics] or [operator] key" if reg.metrics_digests else
                 "for the [operator] key only" if reg.operator_digests else "closed (no [metrics] or [operator] key)")
        for note in () if node else reg.notes():   # a node applies no tenant limit
            log.warning("%s", note)
    return reg


def start_engine(config: EngineConfig, loaded=None) -> EngineLoop:
    """Start the engine thread; it builds the engine, runs the start-up checks, then serves."""
    from kvfence.engine.llm_engine import LLMEngine

    return EngineLoop(lambda: LLMEngine(config, loaded), run_startup_checks).start()


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, tenants_file: str | None = None,
          served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          log_level: str = "info", limits: HttpLimits | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> int:
    tenants = load_tenants(tenants_file)          # a bad tenants file fails before the model loads
    refused = refuse_unusable_port(host, port, "kvfence serve")   # so does a taken port
    if refused is not None:
        return refused
    tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
    if tls_cert:   # unreadable or mismatched: say so now, not after the model has loaded
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls_cert, tls_key)
        except (OSError, ssl.SSLError) as e:
            log.error("not serving: cannot use --tls-cert %s with --tls-key %s: %s", tls_cert, tls_key, e)
            return 2
    log.info("loading the model and sizing the KV pool ...")
    if tenants.single_tenant:   # no other tenant to keep waiting places or running slots for
        config = dataclasses.replace(config, tenant_waiting_share=1.0, tenant_running_share=1.0)
    engine = start_engine(config)
    if not engine.wait_ready():
        log.error("not serving: %s", engine.error)   # e.g. the context does not fit the pool (I8)
        return 2
    for c in engine.startup_checks:
        log.log(logging.ERROR if c["status"] == "failed" else logging.INFO, "start-up check %s (%s): %s - %s",
                c["name"], c["invariant"], c["status"], c["detail"])
    state = ServerState(engine, tenants, served_model_name, max_body_bytes)
    server = uvicorn_server(create_app(state), host, port, limits or HttpLimits(), log_level, access_log=True,
                            refusals=state.metrics.connections,
                            listening=lambda scheme, bound: log.info("serving model %r on %s://%s:%d/v1",
                                                                     state.served_name, scheme, host, bound),
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S, **tls)
    GracefulStop(server, engine, shutdown_timeout_s).install()
    return run_until_engine_fails(server, engine)


EXIT_ENGINE_FAILED = 70   # EX_SOFTWARE; not uvicorn's 3 (it could not bind) nor 2 (refused to start)
EXIT_CANNOT_LISTEN = 3    # what uvicorn exits with when it cannot bind


def refuse_unusable_port(host: str, port: int, who: str) -> int | None:
    """EXIT_CANNOT_LISTEN, with the reason in the log, if host:port cannot be listened on now;
    None if it can. Every role asks before its slow start (the model, or the router's wait
    for its nodes)."""
    why = port_unavailable(host, port)
    if why is None:
        return None
    log.error("%s not serving: %s (choose another --port or --host, or stop what listens there)", who, why)
    return EXIT_CANNOT_LISTEN


def run_until_engine_fails(server, engine: EngineLoop, grace_s: float = 1.0) -> int:
    """Serve until stopped, or until the engine fails for good: then every request in flight
    has been answered with an error, /health/live says so for grace_s, and the process exits
    with EXIT_ENGINE_FAILED so that a supervisor (launch-pd, Kubernetes) restarts it."""
    def stop() -> None:
        log.error("the engine failed (%s): stopping the server in %.0f s, exit code %d", engine.error, grace_s,
                  EXIT_ENGINE_FAILED)
        timer = threading.Timer(grace_s, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    engine.on_failure = stop
    server.run()
    return EXIT_ENGINE_FAILED if engine.error is not None else 0
