"""Fixtures: the shared multi-tenant server, a single-tenant one, and a factory for more."""
from __future__ import annotations

import threading
import tomllib

import pytest
from server_harness import ENGINE, TENANTS_TOML, LiveServer, SpyEngine

from kvfence.engine.config import EngineConfig
from kvfence.server.app import ServerState
from kvfence.server.engine_loop import EngineLoop
from kvfence.server.http_limits import HttpLimits
from kvfence.server.isolation import run_startup_checks
from kvfence.server.tenants import TenantRegistry


@pytest.fixture(scope="session")
def make_server(loaded_bf16):
    started: list[LiveServer] = []

    def make(tenants: str | None = TENANTS_TOML, gate: threading.Event | None = None, wait: bool = True,
             max_body_bytes: int = 256 << 10, limits: HttpLimits | None = None,
             registry: TenantRegistry | None = None, **engine_kw) -> LiveServer:
        cfg = EngineConfig(**{**ENGINE, **engine_kw})
        spy = SpyEngine(cfg, loaded_bf16, gate)
        engine = EngineLoop(spy, run_startup_checks).start()
        if wait:
            assert engine.wait_ready(60), engine.error
        if registry is not None:   # e.g. one read from a file, which a reload reads again
            reg = registry
        else:
            reg = TenantRegistry.single() if tenants is None else TenantRegistry.from_dict(tomllib.loads(tenants))
        srv = LiveServer(ServerState(engine, reg, None, max_body_bytes=max_body_bytes), spy, limits)
        started.append(srv)
        return srv

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(make_server) -> LiveServer:
    """The shared multi-tenant server (tenants in TENANTS_TOML)."""
    return make_server()


@pytest.fixture(scope="session")
def single(make_server) -> LiveServer:
    """A single-tenant server: no tenants file, no key checks."""
    return make_server(tenants=None)

