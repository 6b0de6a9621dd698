"""Property-based fuzzing (hypothesis) of the nodes' internal routes, as the router (with the
credential) could send them, against a real prefill and decode node: random JSON, and valid
bodies with one field replaced by a value of another type or range. Properties: never a
5xx or a dropped connection, every refusal is a 400/413 naming what is wrong, and
afterwards the cluster serves a normal request and both nodes are back at their baseline
(no page owned, no row held, nothing running). KVFENCE_FUZZ_EXAMPLES sets the number of
examples per route (default 40); in CI they are derandomized so a failure reproduces."""
from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_cluster import Cluster

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

EXAMPLES = int(os.environ.get("KVFENCE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pd-fuzz")).start_all()
    yield c
    c.stop()


_scalar = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
           | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False) | st.text(max_size=20))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
_wrong = (_scalar | st.lists(_scalar, max_size=3) | st.sampled_from([3.0, "3", [], {}, -1, 1 << 40, "", "x" * 5000,
                                                                    float(1 << 63), True]))

MANIFEST = dict(request_id="f1", tenant="default", token_count=3, page_count=1, page_size=16, epochs=[1],
                fingerprint="x", layout="x", boot_id="b", seal_salt="0" * 32, slot_bytes=1, slots=[1],
                lease_deadline=0.0)
BODIES = {
    "/internal/prefill": {"request_id": "f1", "tenant": "default", "prompt_ids": [1, 2, 3, 4],
                          "params": {"max_tokens": 2, "temperature": 0.0}},
    "/internal/decode": {"request_id": "f1", "tenant": "default", "prompt_ids": [1, 2, 3, 4],
                         "params": {"max_tokens": 2, "temperature": 0.0},
                         "handoff": {"manifest": MANIFEST, "source": {"session": "127.0.0.1:1", "base": 0,
                                                                      "boot_id": "b"}}},
    "/internal/release": {"request_id": "f1"},
    "/internal/abort": {"request_id": "f1", "reader_stopped": False, "reason": "fuzz"},
    "/internal/stop_pull": {"request_id": "f1"},
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
