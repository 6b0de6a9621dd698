"""A node's internal routes carry the cluster-credential check themselves (I11), so no path
a proxy, a Host header or a path-parsing difference bends can reach one without it."""
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from kvfence.pd.drain import Drain
from kvfence.pd.node import INTERNAL_PREFIX, add_internal_routes, node_app
from kvfence.pd.seal import control_headers
from kvfence.pd.settings import PDSettings
from kvfence.server.backend import EngineFailed
from kvfence.server.errors import APIError
from kvfence.server.tenants import TenantRegistry

SECRET = b"s" * 32


async def _engine_stopped(fn):
    raise EngineFailed("the engine stopped: test")


def _node_app(role: str) -> tuple[FastAPI, list[APIRoute]]:
    """The app and the internal routes it was given (a fake engine loop: the check comes first)."""
    app = FastAPI()
    app.add_exception_handler(APIError, lambda request, e: e.response())
    loop = SimpleNamespace(state="starting", facts=None, error="test", snapshot={}, call=_engine_stopped)
    internal = add_internal_routes(app, loop, PDSettings(role, cluster_secret=SECRET),
                                   Drain(lambda: {}, lambda: None))
    routes = [r for r in internal.routes if isinstance(r, APIRoute)]
    assert routes and all(r.path.startswith(INTERNAL_PREFIX + "/") for r in routes)
    return app, routes


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_internal_route_declares_the_credential_check(role):
    _, routes = _node_app(role)
    assert len(routes) >= 5
    for route in routes:
        checks = [d.call.__name__ for d in route.dependant.dependencies]
        assert "_cluster_only" in checks, route.path


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("host", [None, "x/y?", "a?x", "a#b", "node:1/../v1"])
def test_no_host_header_opens_an_internal_route(role, host):
    app, routes = _node_app(role)
    client = TestClient(app, raise_server_exceptions=False)
    headers = {} if host is None else {"host": host}
    for route in routes:
        method = sorted(route.methods)[0]
        r = client.request(method, route.path, headers=headers, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (route.path, host, r.text)


def test_the_credential_opens_them():
    client = TestClient(_node_app("prefill")[0], raise_server_exceptions=False)
    r = client.get(INTERNAL_PREFIX + "/info", headers=control_headers(SECRET))
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"   # past the check, to the route


def test_a_control_message_to_a_stopped_engine_is_a_503_not_a_500():
    """The router reads 503 as "this node is not serving"; a 500 read as a bug in the node."""
    client = TestClient(_node_app("prefill")[0], raise_server_exceptions=False)
    r = client.post(INTERNAL_PREFIX + "/release", json={"request_id": "r1"}, headers=control_headers(SECRET))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_internal_route_of_the_whole_node_app_takes_only_the_credential(role, monkeypatch):
    """The node's app as serve_node builds it (the server's status routes, the internal routes,
    the test fault switch where enabled): whoever adds an /internal route anywhere in it, not
    only on the internal router, is held to I11 here."""
    monkeypatch.setenv("KVFENCE_TEST_FAULT_CONTROL", "1")
    loop = SimpleNamespace(state="starting", facts=None, error="test", snapshot={}, call=_engine_stopped)
    app, _ = node_app(loop, PDSettings(role, cluster_secret=SECRET), TenantRegistry.single(),
                      Drain(lambda: {}, lambda: None))
    internal = [(path, r) for path, r in _every_route(app.routes) if path.startswith(INTERNAL_PREFIX)]
    assert {path for path, _ in internal} >= {INTERNAL_PREFIX + "/info", INTERNAL_PREFIX + "/drain",
                                              INTERNAL_PREFIX + "/forget_tenants", INTERNAL_PREFIX + "/test/faults"}
    client = TestClient(app, raise_server_exceptions=False)
    for path, route in internal:
        for host in (None, "x/y?", "a#b"):
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                r = client.request(method, path, headers={} if host is None else {"host": host},
                                   json={"spec": "skip_row_auth"})
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, host, r.text)


def _every_route(routes, prefix: str = ""):
    """(path, route) for every route, into included routers (FastAPI keeps an included router
    as one entry that routes to its own list)."""
    for r in routes:
        if hasattr(r, "original_router"):
            yield from _every_route(r.original_router.routes, prefix + r.include_context.prefix)
        else:
            yield prefix + getattr(r, "path", ""), r


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_without_the_credential_a_node_does_not_say_its_role(role, monkeypatch):
    """A security probe told prefill from decode by 401 against 404 on the other role's paths,
    and saw the test fault switch by its 401. Every path under /internal is 401 without the
    credential; with it, another role's path is 404, and the fault switch still works."""
    monkeypatch.setenv("KVFENCE_TEST_FAULT_CONTROL", "1")
    loop = SimpleNamespace(state="starting", facts=None, error="test", snapshot={}, call=_engine_stopped)
    app, _ = node_app(loop, PDSettings(role, cluster_secret=SECRET), TenantRegistry.single(),
                      Drain(lambda: {}, lambda: None))
    client = TestClient(app, raise_server_exceptions=False)
    paths = ["/prefill", "/release", "/abort", "/decode", "/stop_pull", "/nothing", "/test/faults"]
    for path in paths:
        r = client.post(INTERNAL_PREFIX + path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
    other = "/decode" if role == "prefill" else "/prefill"
    r = client.post(INTERNAL_PREFIX + other, json={}, headers=control_headers(SECRET))
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = client.post(INTERNAL_PREFIX + "/test/faults", json={"spec": ""}, headers=control_headers(SECRET))
    assert r.status_code == 200 and r.json() == {"active": []}, r.text
    r = client.post(INTERNAL_PREFIX + "/test/faults", json={"spec": None}, headers=control_headers(SECRET))
    assert r.status_code == 400 and "string" in r.json()["error"], r.text


def _secret_file(path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_reload_of_the_secret_files_changes_what_every_internal_route_takes(tmp_path, monkeypatch):
    """A rotation by reload (SIGHUP calls ServerState.reload_secrets): once the files say NEW
    alone, the old credential is a 401 on the node's internal routes and on its fault switch,
    the new one passes, /internal/info would list NEW's key id; a reload that fails its file
    checks leaves the secrets in force and is counted."""
    from kvfence.pd.seal import Keyring, key_id, new_secret

    monkeypatch.setenv("KVFENCE_TEST_FAULT_CONTROL", "1")
    old, new = new_secret().encode(), new_secret().encode()
    own = tmp_path / "own"
    ring = Keyring.load(_secret_file(own, old.decode()))
    loop = SimpleNamespace(state="starting", facts=None, error="test", snapshot={}, call=_engine_stopped)
    settings = PDSettings("decode", keyring=ring)
    app, state = node_app(loop, settings, TenantRegistry.single(), Drain(lambda: {}, lambda: None))
    client = TestClient(app, raise_server_exceptions=False)

    def status(secret: bytes) -> tuple[int, int]:
        info = client.get(INTERNAL_PREFIX + "/info", headers=control_headers(secret)).status_code
        faults = client.post(INTERNAL_PREFIX + "/test/faults", json={"spec": ""},
                             headers=control_headers(secret)).status_code
        return info, faults

    assert status(old) == (503, 200) and status(new) == (401, 401)   # 503: past the check, not ready
    _secret_file(own, new.decode())
    assert state.reload_secrets("test") and state.last_secret_reload["key_ids"] == [key_id(new)]
    assert status(new) == (503, 200) and status(old) == (401, 401)
    assert settings.secrets.key_ids == [key_id(new)]
    own.chmod(0o644)
    assert not state.reload_secrets("test") and "chmod 600" in state.last_secret_reload["error"]
    assert status(new) == (503, 200)
    metrics = client.get("/metrics").text
    assert 'kvfence_cluster_secret_reloads_total{result="ok"} 1.0' in metrics
    assert 'kvfence_cluster_secret_reloads_total{result="error"} 1.0' in metrics
    assert f'kvfence_cluster_secret_key{{key_id="{key_id(new)}",use="own"}} 1.0' in metrics
    assert key_id(old) not in metrics and new.decode() not in metrics


def test_calls_without_the_credential_are_counted_and_logged_within_a_budget(caplog):
    """An operator sees who probes the PD plane: each refused call counts in
    kvfence_pd_internal_refused_total (the metric the shipped alert rule watches), and the log
    names the address, a few lines a minute per address however many calls come."""
    loop = SimpleNamespace(state="starting", facts=None, error="test", snapshot={}, call=_engine_stopped)
    app, state = node_app(loop, PDSettings("prefill", cluster_secret=SECRET), TenantRegistry.single(),
                          Drain(lambda: {}, lambda: None))
    registry = state.metrics.registry
    assert registry.get_sample_value("kvfence_pd_internal_refused_total") == 0
    client = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level("WARNING", logger="kvfence.pd.node"):
        for i in range(12):
            headers = {} if i % 2 else {"x-kvfence-cluster-token": "0" * 64}
            assert client.post(INTERNAL_PREFIX + "/prefill", json={}, headers=headers).status_code == 401
    assert client.get(INTERNAL_PREFIX + "/info", headers=control_headers(SECRET)).status_code == 503  # not counted
    assert registry.get_sample_value("kvfence_pd_internal_refused_total") == 12
    lines = [r.getMessage() for r in caplog.records if "internal route refused" in r.getMessage()]
    assert len(lines) == 5 and all("'/internal/prefill' from testclient" in m for m in lines), lines
