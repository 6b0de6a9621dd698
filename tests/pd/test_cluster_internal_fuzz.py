"""Property-based fuzzing (hypothesis) of every route of a real PD cluster in one run: the
nodes' internal routes as the router (with the credential) could send them (random JSON,
and valid bodies with one field replaced by a value of another type or range), the router's
public OpenAI routes with the same bodies as the single-node fuzz (tests/fuzz_strategies.py),
and any method on any path of all three processes, with and without the credential.
Properties: never a 5xx or a dropped connection, every refusal names what is wrong, and
afterwards the cluster serves a normal request and both nodes are back at their baseline
(no page owned, no row held, nothing running). KVFENCE_FUZZ_EXAMPLES sets the number of
examples per route (default 40); in CI they are derandomized so a failure reproduces."""
from __future__ import annotations

import json
import time

import fuzz_strategies as fz
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

FUZZ = fz.fuzz_settings(40)


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster   # tests/pd/conftest.py


_scalar = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
           | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False) | st.text(max_size=20))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
_wrong = (_scalar | st.lists(_scalar, max_size=3) | st.sampled_from([3.0, "3", [], {}, -1, 1 << 40, "", "x" * 5000,
                                                                    float(1 << 63), True]))

MANIFEST = dict(request_id="f1", tenant="default", token_count=3, page_count=1, page_size=16, epochs=[1],
                fingerprint="x", layout="x", boot_id="b", seal_salt="0" * 32, seal_key="0" * 16,
                slot_bytes=1, slots=[1],
                lease_deadline=0.0)
BODIES = {
    "/internal/prefill": {"request_id": "f1", "tenant": "default", "prompt_ids": [1, 2, 3, 4],
                          "params": {"max_tokens": 2, "temperature": 0.0},
                          "scope": {"router": "fuzz-router", "epoch": 0}},
    "/internal/decode": {"request_id": "f1", "tenant": "default", "prompt_ids": [1, 2, 3, 4],
                         "params": {"max_tokens": 2, "temperature": 0.0},
                         "handoff": {"manifest": MANIFEST, "source": {"session": "127.0.0.1:1", "base": 0,
                                                                      "boot_id": "b"}}},
    "/internal/release": {"request_id": "f1"},
    "/internal/abort": {"request_id": "f1", "reader_stopped": False, "reason": "fuzz"},
    "/internal/stop_pull": {"request_id": "f1"},
    "/internal/forget_tenants": {"tenants": ["f1"], "router": "fuzz-router", "epoch": 1},
}
ROLE = {"/internal/decode": "decode", "/internal/stop_pull": "decode"}


def _paths(body: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in body.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += _paths(v, prefix + (k,))
    return out


def _replace(body: dict, path: tuple, value) -> dict:
    body = json.loads(json.dumps(body))
    d = body
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return body


@st.composite
def bodies(draw, route: str):
    template = BODIES[route]
    kind = draw(st.sampled_from(["field", "field", "extra", "random"]))
    if kind == "random":
        return draw(_json)
    if kind == "extra":
        return {**template, draw(st.text(min_size=1, max_size=8)): draw(_scalar)}
    return _replace(template, draw(st.sampled_from(_paths(template))), draw(_wrong))


def _send(cluster, route: str, body) -> httpx.Response:
    role = ROLE.get(route, "prefill")
    # request ids unique per example, so a body that happens to be valid is its own request
    if isinstance(body, dict) and body.get("request_id") == "f1":
        body = {**body, "request_id": f"f{time.monotonic_ns()}"}
    with httpx.stream("POST", cluster.url(role) + route, json=body, headers=cluster.headers, timeout=60) as r:
        r.read()   # a streamed answer is read to its end: the node must finish it, not drop it
        return r


@pytest.mark.parametrize("route", sorted(BODIES))
def test_malformed_internal_bodies_never_stop_a_node(cluster, route):
    seen = {}

    @FUZZ
    @given(body=bodies(route))
    def check(body):
        r = _send(cluster, route, body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 413), (r.status_code, r.text[:500])
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and err["message"].startswith("bad internal request"), err

    check()
    print(route, seen)
    assert seen.get(400, 0) > 0
    cluster.wait_quiet(60)
    for role in ("prefill", "decode"):
        assert cluster.info(role)["snapshot"]["running"] == 0
    c = openai.OpenAI(base_url=cluster.url("router") + "/v1", api_key="none", max_retries=0, timeout=60)
    model = c.models.list().data[0].id
    assert c.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                temperature=0).choices[0].finish_reason == "length"


def test_an_oversized_internal_body_is_a_413(cluster):
    big = {"request_id": "big", "tenant": "default", "prompt_ids": [1] * (9 << 20), "params": {}}
    r = httpx.post(cluster.url("prefill") + "/internal/prefill", json=big, headers=cluster.headers, timeout=60)
    assert r.status_code == 413
    assert cluster.info("prefill")["snapshot"]["running"] == 0


@FUZZ
@given(endpoint=st.sampled_from(["completion", "chat"]), data=st.data(), auth=fz.auth, headers=fz.extra_headers)
def test_router_public_routes_never_5xx(cluster, endpoint, data, auth, headers):
    """The router's /v1 API with the single-node fuzz's bodies: each valid one goes through
    prefill, the transfer and decode."""
    body = data.draw(fz.payload(endpoint), label="payload")
    headers = dict(headers)
    if auth is not None:
        headers["Authorization"] = auth
    headers.setdefault("Content-Type", "application/json")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(cluster.url("router") + path, content=body, headers=fz.wire(headers), timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        fz.assert_completion(r, endpoint)
    else:
        fz.assert_openai_error(r)


_any_path = st.sampled_from(["/internal/prefill", "/internal/decode", "/internal/release", "/internal/abort",
                             "/internal/stop_pull", "/internal/forget_tenants",
                             "/internal/info", "/internal/test/faults", "/v1/completions",
                             "/v1/models", "/v1/kvfence/cluster", "/v1/kvfence/isolation", "/metrics",
                             "/health/live", "/health/ready", "/", "/internal/../v1/models", "/internal//info"]) | \
    st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#?%"), max_size=20).map(
        lambda s: "/" + s)


@FUZZ
@given(role=st.sampled_from(["router", "prefill", "decode"]), method=st.sampled_from(["GET", "POST", "PUT", "DELETE",
                                                                                      "PATCH", "OPTIONS", "HEAD"]),
       path=_any_path, credential=st.booleans(), body=st.binary(max_size=64) | _json.map(
           lambda v: json.dumps(v).encode()))
def test_any_method_and_path_on_any_process_never_5xx(cluster, role, method, path, credential, body):
    """Without the credential an internal route is a 401/403 (what an outsider learns: that
    it exists, nothing more); with it, a malformed call is a 4xx, never a 5xx."""
    headers = dict(cluster.headers) if credential else {}
    r = httpx.request(method, cluster.url(role) + path, headers=headers, timeout=60,
                      content=body if method not in ("GET", "HEAD") else None)
    assert r.status_code < 500, (role, method, path, r.status_code, r.text[:300])
    if path.startswith("/internal/") and not credential and r.status_code != 404:
        assert r.status_code in (401, 403, 405), (role, method, path, r.status_code, r.text[:300])


def test_after_all_the_fuzzing_the_cluster_serves_and_is_at_baseline(cluster):
    """Runs last in this module: every route was fuzzed, and nothing stayed held."""
    c = openai.OpenAI(base_url=cluster.url("router") + "/v1", api_key="none", max_retries=0, timeout=60)
    model = c.models.list().data[0].id
    assert c.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                temperature=0).choices[0].finish_reason == "length"
    snaps = cluster.wait_quiet(60)
    for role, snap in snaps.items():
        assert not snap["violations"], (role, snap)
