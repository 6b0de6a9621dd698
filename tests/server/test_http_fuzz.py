"""Property-based fuzzing of the HTTP API (hypothesis) against a real uvicorn server.

Random and malformed bodies (broken JSON, invalid UTF-8, NaN literals, lone surrogates,
wrong types, huge and negative numbers, unknown fields), random keys and headers, for
/v1/completions and /v1/chat/completions, and random methods and paths. Properties:

  - never a 5xx;
  - every error is OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}};
  - every 200 is a well-formed completion, or a well-formed event stream with no error in it;
  - afterwards a normal request still succeeds and every KV page is back in the pool.

The server's context is 96 tokens, so even a valid request that asks for the most tokens
stays cheap. KVFENCE_FUZZ_EXAMPLES sets the number of examples (default 150); in CI the
examples are derandomized so a failure reproduces.
"""
from __future__ import annotations

import fuzz_strategies as fz
import httpx
import pytest
from fuzz_strategies import KEYS, MODEL, assert_completion, assert_openai_error
from hypothesis import given
from hypothesis import strategies as st
from server_harness import pool_intact, wait_for

FUZZ = fz.fuzz_settings(150)


@pytest.fixture(scope="module")
def fuzz_server(make_server):
    srv = make_server(max_model_len=96)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as c:
        yield c


@FUZZ
@given(endpoint=st.sampled_from(["completion", "chat"]), data=st.data(), auth=fz.auth, headers=fz.extra_headers)
def test_generation_endpoints_never_5xx(http, endpoint, data, auth, headers):
    payload = data.draw(fz.payload(endpoint), label="payload")
    headers = dict(headers)
    if auth is not None:
        headers["Authorization"] = auth
    headers.setdefault("Content-Type", "application/json")
    headers = fz.wire(headers)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = http.post(path, content=payload, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        assert_completion(r, endpoint)
    else:
        assert_openai_error(r)


_paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", f"/v1/models/{MODEL}",
                          "/v1/models/..%2f..%2fetc", "/v1/kvfence/isolation", "/v1/embeddings", "/v1", "/",
                          "/tokenize", "/detokenize",
                          "/v1/completions/", "//v1//models", "/v1/chat/completions?stream=true"]) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#?%"), max_size=20).map(lambda s: "/" + s)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]), path=_paths,
       auth=fz.auth, body=st.binary(max_size=32))
def test_any_method_and_path_never_5xx(http, method, path, auth, body):
    headers = fz.wire({"Authorization": auth} if auth is not None else {})
    r = http.request(method, path, headers=headers, content=body if method not in ("GET", "HEAD") else None)
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    if r.status_code >= 400 and method != "HEAD":
        assert_openai_error(r)


def test_after_fuzzing_the_server_serves_and_the_pool_is_whole(fuzz_server, http):
    """Runs after the fuzz tests in this module (pytest keeps file order)."""
    r = http.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                  json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    snap = wait_for(lambda: (lambda s: s if pool_intact(s) else None)(fuzz_server.wait_idle()), timeout=30)
    assert snap, fuzz_server.engine.snapshot
    assert snap["pages_free"] + snap["pages_shared"] == snap["pages_total"] and snap["pages_owned"] == 0
    assert fuzz_server.engine.state == "ready" and not snap["violations"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1, "max_tokens": 2}', None),
])
def test_lone_surrogate_escape_is_a_400(http, path, body, param):
    """Found by the fuzzer: JSON can escape half a surrogate pair on its own; the tokenizer
    refused the resulting string and the server answered 500 (and reset the connection)."""
    r = http.post(path, content=body.encode(), headers={"Authorization": f"Bearer {KEYS['alice']}",
                                                        "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
    ok = http.post(path, content=b'{"prompt": "\\ud83d\\ude00", "messages": [{"role": "user", "content": '
                   b'"\\ud83d\\ude00"}], "max_tokens": 1}', headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert ok.status_code == 200, ok.text  # a proper pair is one character, and fine
