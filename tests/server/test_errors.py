"""Errors in OpenAI's shape, with the right status and code, and the server keeps serving:
400 (malformed, over-length), 401, 404, 413, 429 (see test_tenants), 500 on an isolation
abort (see test_observability), 503 while the engine is not ready."""
from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import openai
import pytest
from server_harness import MODEL, SCRAPER_KEY, pool_intact, wait_for

from kvfence.server.log_budget import LogBudget

OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def test_context_length_exceeded_names_limit_and_token_count(server, loaded_fp32):
    c = server.client()
    prompt = "hello " * 1400
    n = len(loaded_fp32.tokenizer.encode(prompt))
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=100)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    msg = e.value.message
    assert "1440" in msg and str(n + 100) in msg and f"{n} in the prompt" in msg
    # a max_tokens the context cannot hold beside any prompt is the max_tokens' fault, said so
    # under the name the client sent (before: "at most 0 prompt tokens fit", param "messages")
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=hi, max_tokens=5000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert "'max_tokens' is 5000" in e.value.message and "1440" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=hi, max_completion_tokens=1440)
    assert e.value.param == "max_completion_tokens" and "'max_completion_tokens' is 1440" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=10**6)
    assert e.value.param == "max_output_tokens" and "'max_output_tokens' is 1000000" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1440)
    assert e.value.param == "max_tokens" and "a completion then has 16 tokens" in e.value.message
    opening = [e.value.body["message"]]
    with pytest.raises(openai.BadRequestError) as e:   # surely too long, by its characters alone
        c.completions.create(model=MODEL, prompt="x" * 200_000, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "characters are at least" in e.value.message
    opening.append(e.value.body["message"])
    # clients tell a context overflow by OpenAI's opening words (LiteLLM's ContextWindowExceededError,
    # and with it context_window_fallbacks); found by a framework probe
    assert all(m.lower().startswith("this model's maximum context length is") for m in opening), opening
    with pytest.raises(openai.BadRequestError) as e:   # one token less fits no prompt of two
        c.chat.completions.create(model=MODEL, messages=hi, max_tokens=1439)
    assert e.value.param == "messages" and "at most 1 prompt tokens fit" in e.value.message
    # nothing was allocated for them and the server goes on
    assert server.engine.snapshot["pages_owned"] == 0 and pool_intact(server.engine.snapshot)
    assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_more_messages_than_any_conversation_needs_are_refused_before_rendering(server, monkeypatch):
    """Rendering runs the chat template in Python, beside the engine's thread (a probe's 250K
    one-letter messages took ~1.6 s before their refusal)."""
    from kvfence.server.protocol import MAX_MESSAGES

    tok = server.engine.tokenizer
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: pytest.fail("rendered"))
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=many, max_tokens=2)
    assert e.value.param == "messages" and f"at most {MAX_MESSAGES} are taken" in e.value.message
    monkeypatch.undo()
    assert server.client().chat.completions.create(model=MODEL, messages=many[:3], max_tokens=2).choices


def test_missing_and_unknown_key_are_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client("sk-not-a-real-key").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json=OK_COMPLETION)
    assert_openai_error(r, 401, code="invalid_api_key")
    r = httpx.post(server.url + "/v1/completions", json=OK_COMPLETION, headers={"Authorization": "Basic abc"})
    assert_openai_error(r, 401)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/kvfence/isolation").status_code == 401


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and "gpt-9" in e.value.message
    assert e.value.type == "invalid_request_error"    # OpenAI's type for it (and for a missing route)
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-9")
    with server.http() as h:
        assert_openai_error(h.get("/v1/no-such-route"), 404)


def test_not_ready_is_503_then_serves(make_server):
    gate = threading.Event()
    srv = make_server(gate=gate, wait=False)
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 503 and r.json()["status"] == "loading" and r.json()["ready"] is False
    assert httpx.get(srv.url + "/health/live").status_code == 200
    with pytest.raises(openai.InternalServerError) as e:
        srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "model_not_ready"
    gate.set()
    assert srv.engine.wait_ready(60)
    assert httpx.get(srv.url + "/health").status_code == 200
    assert srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_engine_that_cannot_start_fails_closed_with_503(make_server):
    # 16 MiB holds fewer tokens than the model's context and clamping is off: I8 refuses
    srv = make_server(wait=False, kv_cache_memory="16MiB", clamp_context=False)
    assert wait_for(lambda: srv.engine.state == "failed", 30)
    r = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {SCRAPER_KEY}"})
    assert r.status_code == 503 and "exceeds the KV pool capacity" in r.json()["error"]
    assert httpx.get(srv.url + "/health/live").status_code == 503
    with srv.http() as h:
        assert_openai_error(h.post("/v1/completions", json=OK_COMPLETION), 503, code="engine_unavailable")


BAD_BODIES = [
    # (endpoint, raw body or JSON value, expected param, expected status)
    ("completions", b'{"prompt": "x", ', None, 400),                         # invalid JSON
    ("completions", b"[1, 2, 3]", None, 400),                                # not an object
    ("completions", b"", None, 400),                                         # empty body
    ("completions", b'{"prompt": "\xff\xfe caf\xe9"}', None, 400),           # invalid UTF-8
    ("completions", b'{"prompt": "x", "temperature": NaN}', None, 400),      # not JSON
    ("completions", b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens", 400),  # a float, and infinite
    ("completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens", 400),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens", 400),
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", 400),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ("completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens", 400),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", 400),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature", 400),
    ("completions", {"prompt": "x", "temperature": 1e308}, "temperature", 400),
    ("completions", {"prompt": "x", "top_p": -0.1}, "top_p", 400),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", 400),
    ("completions", {"prompt": "x", "top_p": True}, "top_p", 400),
    ("completions", {"prompt": "x", "seed": 1.5}, "seed", 400),
    ("completions", {"prompt": "x", "seed": 10**30}, "seed", 400),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs", 400),
    ("completions", {"prompt": "x", "logprobs": 1000}, "logprobs", 400),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream", 400),
    ("completions", {"prompt": "x", "stop": 5}, "stop", 400),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", 400),
    ("completions", {"prompt": "x", "stop": ["x" * 5000]}, "stop", 400),              # the PD wire's bound too
    # found in review, each a 500 before: an integer past Python's 4300-digit limit, a number too
    # large for a float, and tool-call arguments nested past the recursion limit (not JSON to it, so
    # written back as the text they are, whose length is then what the 400 is for)
    ("completions", b'{"prompt": "x", "metadata": {"a": ' + b"1" * 5000 + b"}}", None, 400),
    ("completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature", 400),
    ("completions", b'{"prompt": "x", "logit_bias": {"5": 1' + b"0" * 400 + b"}}", "logit_bias", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}]}]},
     "messages", 400),
    ("completions", {"prompt": "x", "stop_token_ids": [2**32]}, "stop_token_ids", 400),
    ("completions", {"prompt": "x", "stop_token_ids": [1] * 1025}, "stop_token_ids", 400),
    ("completions", {"prompt": "x", "n": 17}, "n", 400),
    ("completions", {"prompt": "x", "n": 0}, "n", 400),
    ("completions", {"prompt": ["a", "b"], "n": 9}, "prompt", 400),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of", 400),
    ("completions", {"prompt": "x", "echo": False, "max_tokens": 0}, "max_tokens", 400),  # 0 only with echo
    ("completions", {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens", 400),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix", 400),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", 400),
    ("completions", {"prompt": ""}, "prompt", 400),
    ("completions", {"prompt": []}, "prompt", 400),
    ("completions", {"prompt": 5}, "prompt", 400),
    ("completions", {"prompt": ["a", ""]}, "prompt", 400),
    ("completions", {"prompt": ["a", 5]}, "prompt", 400),
    ("completions", {"prompt": ["a"] * 17}, "prompt", 400),
    ("completions", {"prompt": [1, 2, 99999999]}, "prompt", 400),
    ("completions", {"prompt": [1, -2]}, "prompt", 400),
    ("completions", {"max_tokens": 3}, "prompt", 400),
    ("completions", {"prompt": "x", "model": 7}, "model", 400),
    ("chat/completions", {"messages": "hi"}, "messages", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", 400),
    ("chat/completions", {"messages": []}, "messages", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
     "max_completion_tokens", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0]", 400),   # a tool without its function (tools themselves work: test_tools.py)
]


@pytest.mark.parametrize("endpoint,body,param,status", BAD_BODIES,
                         ids=[f"{i}-{e}" for i, (e, *_) in enumerate(BAD_BODIES)])
def test_malformed_input_is_400_in_openai_shape(server, endpoint, body, param, status):
    with server.http() as h:
        if isinstance(body, bytes):
            r = h.post(f"/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
        else:
            r = h.post(f"/v1/{endpoint}", json=body)
        err = assert_openai_error(r, status, param=param if param is not None else "any")
        assert err["type"] == "invalid_request_error"


def test_oversized_body_is_413_and_server_keeps_serving(server):
    big = {"model": MODEL, "prompt": "x" * (300 << 10), "max_tokens": 1}      # over the test server's 256 KiB
    with server.http() as h:
        err = assert_openai_error(h.post("/v1/completions", json=big), 413, code="request_too_large")
        assert str(256 << 10) in err["message"]
        # chunked upload without Content-Length is cut off the same way
        def gen():
            for _ in range(300):
                yield b"x" * 1024
        r = h.post("/v1/completions", content=gen(), headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413)
        assert h.post("/v1/completions", json=OK_COMPLETION).status_code == 200
        assert h.post("/v1/chat/completions", json=OK_CHAT).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_after_every_error_the_server_serves_everyone(server):
    before = server.metric("kvfence_requests_total", tenant="alice", outcome="invalid")
    with server.http() as h:
        for _, body, _, _ in BAD_BODIES[:12]:
            if isinstance(body, bytes):
                h.post("/v1/completions", content=body)
            else:
                h.post("/v1/completions", json=body)
        assert h.post("/v1/completions", json=OK_COMPLETION).json()["usage"]["completion_tokens"] == 2
    assert server.metric("kvfence_requests_total", tenant="alice", outcome="invalid") == before + 12
    r = server.client("bob").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, temperature=0)
    assert r.usage.completion_tokens > 0


def test_requests_an_engine_crash_ends_count_as_server_failures(make_server):
    """An answer in flight when the engine stops is a failure the server counts by its code,
    streamed or not: the unstreamed one was counted as a plain error and not in
    kvfence_request_failures_total, where an operator looks up which errors fail requests (review)."""
    srv = make_server()
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 500, "ignore_eos": True}

    def errors() -> tuple[float, ...]:
        return (srv.metric("kvfence_request_failures_total", code="engine_unavailable"),
                srv.metric("kvfence_requests_total", tenant="alice", outcome="error"),
                srv.metric("kvfence_requests_total", tenant="bob", outcome="error"))

    before = errors()
    answers: list[httpx.Response] = []
    with srv.http("bob") as whole_client, srv.http("alice") as h:
        whole = threading.Thread(target=lambda: answers.append(whole_client.post("/v1/completions", json=body)))
        whole.start()
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = r.iter_lines()
            assert next(events).startswith("data: ")
            deadline = time.monotonic() + 30
            while srv.metric("kvfence_requests_running") < 2:   # the unstreamed one runs too
                assert time.monotonic() < deadline
                time.sleep(0.05)
            srv.spy.crash = True
            rest = [line for line in events if line.startswith("data: ")]
        whole.join(60)
    assert '"code":"engine_unavailable"' in rest[-1]
    assert_openai_error(answers[0], 503, code="engine_unavailable")
    assert errors() == (before[0] + 2, before[1] + 1, before[2] + 1)


def test_engine_crash_fails_requests_closed_and_health_says_so(make_server, caplog):
    srv = make_server()
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with srv.http() as h, caplog.at_level(logging.WARNING, logger="kvfence"):
        with h.stream("POST", "/v1/completions", json=body) as r:
            events = r.iter_lines()
            first = next(events)
            assert first.startswith("data: ")
            srv.spy.crash = True
            rest = [line for line in events if line.startswith("data: ")]
        # the crash's text is the engine's internals: a tenant gets the request id to quote,
        # the operator's log has the text under it
        rid = json.loads(first[6:])["id"]
        assert '"code":"engine_unavailable"' in rest[-1] and "injected engine crash" not in rest[-1]
        assert rid in rest[-1] and "operator's log" in rest[-1]
        assert any(rid in m.getMessage() and "injected engine crash" in m.getMessage() for m in caplog.records)
        assert_openai_error(h.post("/v1/completions", json=OK_COMPLETION), 503, code="engine_unavailable")
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    # why: for the operator's keys only (on a router it names every node's URL; found in review)
    assert "error" not in health.json()
    with srv.http() as h:
        r = h.post("/v1/completions", json=OK_COMPLETION)
        assert r.status_code == 503 and "injected engine crash" not in r.text, r.text
    health = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {SCRAPER_KEY}"})
    assert "injected engine crash" in health.json()["error"]
    # wrong /metrics keys throttle this address; its readiness probe still gets the status
    # (not a 429), without the reason (no key is checked while throttled; found in review)
    from kvfence.server.auth_throttle import LIMIT

    for _ in range(LIMIT):
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer sk-guess-00000"}).status_code == 401
    health = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {SCRAPER_KEY}"})
    assert health.status_code == 503 and health.json()["status"] == "failed" and "error" not in health.json()
    assert httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}).status_code == 429
    assert httpx.get(srv.url + "/openapi.json").status_code == 404     # no route list for anyone


def test_idle_engine_thread_blocks_instead_of_spinning(server):
    server.wait_idle()
    before = server.engine.iterations
    import time

    time.sleep(0.5)
    assert server.engine.iterations == before                    # no loop turns while idle
    server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert server.engine.iterations > before                     # and it wakes for work


def test_generated_logprobs_are_bounded_like_prompt_logprobs(server, monkeypatch):
    """Found in review: prompt logprobs were capped, generated ones were not; n=16 x 8192 tokens
    x 21 entries is ~2.75M logprob objects built and serialised on the event loop, stalling
    every tenant's streams. The same bound now applies (lowered here to fit the test's context)."""
    from kvfence.server import app as app_mod

    monkeypatch.setattr(app_mod, "MAX_LOGPROB_ENTRIES", 1000)
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={**OK_CHAT, "n": 2, "max_tokens": 30, "logprobs": True,
                                                  "top_logprobs": 20})
        err = assert_openai_error(r, 400, param="top_logprobs")
        assert "1260 entries" in err["message"]
        r = h.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 30, "logprobs": 20})
        assert r.status_code == 200, r.text


def test_a_single_tenant_client_is_the_operator_and_sees_why(make_server):
    """Without a tenants file nobody else's internals are at stake: the detail stays in the error."""
    srv = make_server(tenants=None)
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with srv.http(None) as h, h.stream("POST", "/v1/completions", json=body) as r:
        events = r.iter_lines()
        assert next(events).startswith("data: ")
        srv.spy.crash = True
        rest = [line for line in events if line.startswith("data: ")]
    assert '"code":"engine_unavailable"' in rest[-1] and "injected engine crash" in rest[-1]


def test_every_answer_and_refusal_carries_a_request_id_the_log_names(server, caplog):
    """Found by an operator walkthrough: a 400 left no line in the log (only the access line,
    with no tenant, request or reason) and no id the client could quote. Every answer now has
    x-request-id (the official client's `_request_id`), and each refusal's log line names it,
    the tenant, the status, the code and the parameter, never what the client sent."""
    c = server.client("alice")
    ok = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=2)
    assert ok.headers["x-request-id"] == ok.parse().id and ok.parse().id.startswith("chatcmpl-")
    with c.completions.with_streaming_response.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True) as s:
        assert s.headers["x-request-id"].startswith("cmpl-")
    server.state.refusal_lines = LogBudget()   # other tests' refusals of alice may have used up this window's
    with caplog.at_level(logging.DEBUG, logger="kvfence.server"):
        r = httpx.post(server.base_url + "/completions", json={**OK_COMPLETION, "max_tokens": "secret-words-here"},
                       headers={"Authorization": "Bearer sk-alice-0001"}, timeout=30)
        assert_openai_error(r, 400, param="max_tokens")
        rid = r.headers["x-request-id"]
        bad_key = httpx.post(server.base_url + "/completions", json=OK_COMPLETION,
                             headers={"Authorization": "Bearer sk-nobody-0000"}, timeout=30)
    assert bad_key.status_code == 401 and bad_key.headers["x-request-id"].startswith("cmpl-")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvfence.server"]
    assert f"{rid} tenant=alice refused: 400 " in "\n".join(lines) and "param='max_tokens'" in "\n".join(lines), lines
    keyless = next(rec for rec in caplog.records if bad_key.headers["x-request-id"] in rec.getMessage())
    assert "tenant=unauthenticated refused: 401 invalid_api_key" in keyless.getMessage()
    assert keyless.levelno == logging.DEBUG   # anyone without a key could fill the log at INFO
    assert "secret-words-here" not in "\n".join(lines)


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "hi", "x\\n2026-01-01 ERROR forged-line": "\\ud800"}', None),        # a key that is no field
    ('{"prompt": "hi", "max_tokens": 2, "metadata": {"k\\nforged-line": 5}}', "metadata"),
])
def test_a_refusal_names_no_field_that_is_the_clients_own_text(server, caplog, raw, param):
    """Found in review: a top-level key holding a lone surrogate, or a metadata key, became the
    error's param, in the answer and in the refusal's log line, whole: newlines forged log
    lines and a 4 MiB key made a 4 MiB line. Only plain field names are named now."""
    server.state.refusal_lines = LogBudget()
    with caplog.at_level(logging.DEBUG, logger="kvfence.server"):
        r = httpx.post(server.base_url + "/completions", content=raw.encode(), timeout=30,
                       headers={"Authorization": "Bearer sk-alice-0001", "Content-Type": "application/json"})
    assert_openai_error(r, 400, param=param)
    assert "forged-line" not in r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvfence.server"]
    assert any(r.headers["x-request-id"] in line for line in lines), lines
    assert not any("forged-line" in line or "\n" in line for line in lines), lines


def test_a_tenant_looping_on_a_refusal_adds_a_bounded_number_of_log_lines(server, caplog):
    """Found in review: each refused request of a known tenant wrote a line, so a client looping
    on a 404 or its 429 filled the log at its own pace. Past its budget the lines are counted,
    and the next one written says how many were left out."""
    from kvfence.server.log_budget import PER_WINDOW

    now = [0.0]
    server.state.refusal_lines = LogBudget(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvfence.server"), server.http("bob") as h:
        for _ in range(PER_WINDOW + 30):
            assert h.post("/v1/completions", json={**OK_COMPLETION, "model": "no-such-model"}).status_code == 404
        now[0] = 60.0
        assert h.post("/v1/completions", json={**OK_COMPLETION, "model": "no-such-model"}).status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if "tenant=bob refused" in rec.getMessage()]
    assert len(lines) == PER_WINDOW + 1, len(lines)
    assert lines[-1].endswith("(30 earlier refusal(s) of this tenant not logged)"), lines[-1]


def _nested(depth: int) -> str:
    """JSON text of a schema nested `depth` objects deep (two JSON levels each), written as text:
    the test's own JSON encoder recurses as deep as the server's printer."""
    return '{"type":"object","properties":{"x":' * depth + '{"type":"string"}' + "}}" * depth


@pytest.mark.parametrize("route,body,param", [
    ("/v1/responses", json.dumps({"input": "hi", "include": 5}), "include"),
    ("/v1/responses", json.dumps({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                                             "arguments": "[" * 100_000}]}), "input"),   # as text: too long
    # parsed off the loop (over 64 KB), where the stack is shallow, then printed into the prompt:
    # on the loop, where the stack is deeper, that was a RecursionError (the tools are rendered
    # in the tokenizing thread now, and a RecursionError anywhere is a 400); now the prompt's
    # length is what refuses it
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi ' + "x" * 70_000 + '"}], "max_tokens": 1, '
                             '"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                             + _nested(480) + "}}]}", "messages"),
], ids=["include-number", "deep-arguments", "deep-tool-parameters"])
def test_client_shapes_that_were_500s_are_400s(server, route, body, param):
    """Found in review: each of these was an unhandled TypeError or RecursionError (500), and
    the server serves the next request as before."""
    body = '{"model": "' + MODEL + '", ' + body[1:]
    r = httpx.post(server.url + route, content=body, timeout=60,
                   headers={"Authorization": "Bearer sk-alice-0001", "Content-Type": "application/json"})
    assert_openai_error(r, 400, param=param)
    assert server.client("alice").completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_a_body_of_millions_of_small_arrays_is_refused_before_it_is_parsed(server, monkeypatch):
    """json.loads holds the GIL throughout, in any thread: 8 MiB of [1] arrays stopped every
    stream for ~0.6 s a request. An unknown field carries them, so without the bound the
    request would be served."""
    from kvfence.server.app import DEFAULT_MAX_BODY_BYTES
    from kvfence.server.protocol import MAX_JSON_CONTAINERS

    monkeypatch.setattr(server.state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)   # the default's, not the tests'
    body = (b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "max_tokens": 1, "x": ['
            + b",".join([b"[1]"] * (MAX_JSON_CONTAINERS * 4)) + b"]}")
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": "Bearer sk-alice-0001", "Content-Type": "application/json"})
    assert_openai_error(r, 400)
    assert "objects and arrays" in r.json()["error"]["message"]
    assert server.client("alice").completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_a_recursion_error_nothing_converted_is_a_logged_400_and_the_server_serves_on(server, monkeypatch, caplog):
    """The last resort for a body nested deeper than some printer recurses: the client gets a
    400 that says so, the operator a log line naming the route (it may be a bug of ours)."""
    import kvfence.server.app as app_mod

    def too_deep(body):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(app_mod, "parse_completion", too_deep)
    with caplog.at_level("WARNING", logger="kvfence.server"), server.http("alice") as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_openai_error(r, 400)
    assert "nested too deeply" in r.json()["error"]["message"] and r.headers.get("x-request-id")
    assert any("RecursionError on POST '/v1/completions'" in m for m in caplog.messages), caplog.messages
    monkeypatch.undo()
    assert server.client("alice").completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_small_answers_do_not_wait_for_the_large_answers_builders(server):
    """Found in review: every answer was built in one two-thread pool, so a tenant's large echo
    and logprobs answers held up every other tenant's one-line answer. Both builders held here:
    a plain answer and one with a few logprobs still come back; a large one waits for them."""
    import kvfence.server.app as app_mod

    gate = threading.Event()
    held = [app_mod._ANSWER_BUILDERS.submit(gate.wait, 60) for _ in range(2)]
    try:
        plain = server.client("alice", timeout=30).completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert plain.choices[0].text is not None
        few = server.client("alice", timeout=30).completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=5)
        assert len(few.choices[0].logprobs.tokens) == 4
        big = app_mod.INLINE_ANSWER_ENTRIES   # echo, 20 top logprobs: past the bound, so built in the pool
        with pytest.raises(openai.APITimeoutError):
            server.client("alice", timeout=3).completions.create(model=MODEL, prompt="Hi " * (big // 20), max_tokens=1,
                                                                  echo=True, logprobs=20)
    finally:
        gate.set()
        for f in held:
            f.result(timeout=30)
    assert server.client("alice").completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_a_large_body_is_checked_and_rendered_off_the_event_loop(server, monkeypatch):
    """Found in review: the big-body rule looked at the top-level lengths of prompt and
    messages only, so 125K Responses items (8 MiB) or a megabyte of tool schema were checked
    and rendered on the event loop, about a second each with every stream stalled. Now the
    body's size decides, as it does for parsing the JSON."""
    import kvfence.server.app as app_mod

    where: dict[str, list] = {"parse": [], "render": []}
    parse_chat, render = app_mod.parse_chat, app_mod.render_tools
    monkeypatch.setattr(app_mod, "parse_chat", lambda b: where["parse"].append(threading.current_thread()) or
                        parse_chat(b))
    monkeypatch.setattr(app_mod, "render_tools", lambda *a: where["render"].append(threading.current_thread()) or
                        render(*a))
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "description": "d" * 70_000}}
    for big in (False, True):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "tools": [tool] if big else []}
        r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": "Bearer sk-alice-0001"},
                       timeout=60)
        assert r.status_code == (400 if big else 200), r.text   # the big schema is rendered: too long
        loop_thread = server.thread
        assert (where["parse"][-1] is loop_thread) is not big and (where["render"][-1] is loop_thread) is False


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions/chatcmpl-123"), ("GET", "/v1/chat/completions"),
                                         ("DELETE", "/v1/chat/completions/chatcmpl-123"),
                                         ("GET", "/v1/chat/completions/chatcmpl-123/messages"),
                                         ("GET", "/v1/responses/resp_123"), ("GET", "/v1/responses")])
def test_looking_up_a_stored_answer_says_nothing_is_stored(server, method, path):
    """A client that sent store: true and looked its answer up got "No route" (a framework probe)."""
    r = httpx.request(method, server.url + path, headers={"authorization": "Bearer sk-alice-0001"}, timeout=30)
    assert r.status_code in (404, 405) and "stores no chat completion or response" in r.json()["error"]["message"]


@pytest.mark.parametrize("method,path", [("POST", "/v1/embeddings"), ("POST", "/v1/audio/transcriptions"),
                                         ("POST", "/v1/images/generations"), ("POST", "/v1/files"),
                                         ("GET", "/v1/batches"), ("POST", "/v1/moderations")])
def test_a_part_of_the_openai_api_that_is_not_served_says_so(server, method, path):
    """A framework's embeddings call got "No route POST /v1/embeddings.", as for a typo: it now
    says what is served instead. A typo still gets the bare answer."""
    r = httpx.request(method, server.url + path, headers={"authorization": "Bearer sk-alice-0001"}, json={},
                      timeout=30)
    msg = r.json()["error"]["message"]
    assert r.status_code in (404, 405) and "not served here" in msg and "/v1/chat/completions" in msg, msg
    r = httpx.post(server.url + "/v1/embeddingz", headers={"authorization": "Bearer sk-alice-0001"}, json={},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "No route POST /v1/embeddingz.", r.text
