"""A taken port is refused before the model loads (or the router waits for its nodes), with
the reason; uvicorn alone found it only once the server started, minutes later with a large
model, after logging that it served (found by an operator walkthrough)."""
from __future__ import annotations

import logging
import socket

import pytest

from kvfence.engine.config import EngineConfig
from kvfence.pd.settings import PDSettings
from kvfence.pd.tls import TlsSettings
from kvfence.server.http_limits import port_unavailable
from kvfence.server.serve import EXIT_CANNOT_LISTEN


@pytest.fixture
def taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _never(*a, **kw):
    raise AssertionError("started loading although the port is taken")


def test_the_check_names_a_taken_port_and_passes_a_free_one(taken):
    assert port_unavailable("127.0.0.1", taken) == \
        f"cannot listen on 127.0.0.1:{taken} (127.0.0.1): it is already in use"
    assert "already in use" in port_unavailable("localhost", taken)   # every address of a name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert port_unavailable("127.0.0.1", free) is None
    assert "cannot listen on 192.0.2.1" in port_unavailable("192.0.2.1", free)   # not this machine's address


def test_serve_refuses_a_taken_port_before_loading(taken, monkeypatch, caplog):
    from kvfence.server import serve as serve_module

    monkeypatch.setattr(serve_module, "start_engine", _never)
    with caplog.at_level(logging.ERROR, logger="kvfence.server"):
        assert serve_module.serve(EngineConfig(), port=taken) == EXIT_CANNOT_LISTEN
    assert "it is already in use" in caplog.text


def test_nodes_and_the_router_refuse_a_taken_port_before_starting(taken, monkeypatch):
    from kvfence.pd import node, router

    monkeypatch.setattr(node, "EngineLoop", _never)
    assert node.serve_node(EngineConfig(), PDSettings(role="prefill", cluster_secret=b"s" * 32), "127.0.0.1", taken,
                           TlsSettings()) == EXIT_CANNOT_LISTEN
    monkeypatch.setattr(router, "RouterBackend", _never)
    assert router.serve_router(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], None, "127.0.0.1", taken, None, False,
                               b"s" * 32, TlsSettings()) == EXIT_CANNOT_LISTEN


def test_the_serving_line_names_the_port_the_system_chose_for_port_0():
    """`--port 0` logged "serving on ...:0" (found by an operator walkthrough): the roles now
    say where they serve once the socket is bound, with its real port and scheme."""
    import threading
    import time

    from kvfence.server.http_limits import HttpLimits, uvicorn_server

    async def app(scope, receive, send):   # nothing is asked of it
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    heard: list[tuple[str, int]] = []
    server = uvicorn_server(app, "127.0.0.1", 0, HttpLimits(), log_config=None,
                            listening=lambda scheme, port: heard.append((scheme, port)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert server.started
        (scheme, port), = heard
        assert scheme == "http" and port == server.servers[0].sockets[0].getsockname()[1] and port != 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass   # it is the address a client can use
    finally:
        server.should_exit = True
        thread.join(10)
