"""Tenants: identity from the API key only, per-tenant limits, keys and prompts never logged,
and the tenants file's validation."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest
from server_harness import KEYS, MODEL, TENANTS_TOML, wait_for

from kvfence.server.errors import APIError
from kvfence.server.tenants import Limits, Tenant, TenantLimiter, TenantRegistry, TenantsFileError

TENANTS_TOML_WITH_BILLED = TENANTS_TOML + ('\n[tenants.billed]\napi_keys = ["sk-billed-0001"]\n'
                                           'tokens_per_minute = 10000\n')


def _rid_tenant(server, rid: str) -> str:
    tenant, prompt = server.spy.seen[rid]
    assert prompt is None            # the engine never gets the prompt text
    return tenant


def test_tenant_comes_from_the_key_never_from_the_request(server):
    c = server.client("alice")
    r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="bob",
                             extra_body={"tenant": "bob", "tenant_id": "bob"},
                             extra_headers={"X-Tenant": "bob", "OpenAI-Organization": "bob"})
    assert _rid_tenant(server, r.id) == "alice"
    r = server.client("alice2").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2, user="bob")
    assert _rid_tenant(server, r.id) == "alice"     # alice's second key: still alice
    r = server.client("bob").completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="alice")
    assert _rid_tenant(server, r.id) == "bob"


def test_single_tenant_mode_needs_no_key_and_says_so(single):
    r = single.client("anything-at-all").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _rid_tenant(single, r.id) == "default"
    r = httpx.post(single.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})   # no key, no model
    assert r.status_code == 200 and _rid_tenant(single, r.json()["id"]) == "default"
    tenancy = single.client().get("/kvfence/isolation", cast_to=object)["kv_memory_isolation"]["tenancy"]
    assert tenancy["mode"] == "single-tenant" and "not checked" in tenancy["identity"]


def test_a_key_reads_its_own_limits_in_the_model_card(make_server):
    """A client can size its requests before one is refused: /v1/models shows the calling
    key's own limits (null: none), never another tenant's; without a tenants file there are
    none to show."""

    srv = make_server(tenants=TENANTS_TOML + '\n[tenants.brief]\napi_keys = ["sk-brief-00001"]\n'
                      'default_max_tokens = 5\nmax_prompt_tokens = 300\n')
    card = srv.client("sk-brief-00001").models.list().data[0].model_dump()
    limits = card["tenant_limits"]
    assert limits == {"max_prompt_tokens": 300, "max_concurrent_requests": limits["max_concurrent_requests"],
                      "tokens_per_minute": None, "requests_per_minute": None, "default_max_tokens": 5}
    assert limits["max_concurrent_requests"] >= 1     # the tenants file's default share of the node
    assert card["max_model_len"] > 300
    other = srv.client("metered").models.retrieve(MODEL).model_dump()["tenant_limits"]
    assert other["tokens_per_minute"] is not None and other["default_max_tokens"] is None


def test_single_tenant_mode_has_no_tenant_limits_to_show(single):
    assert "tenant_limits" not in single.client().models.list().data[0].model_dump()


def test_single_tenant_mode_is_announced_at_start_up(caplog):
    from kvfence.server.serve import load_tenants

    with caplog.at_level(logging.INFO):
        reg = load_tenants(None)
    assert reg.single_tenant
    assert any("SINGLE-TENANT" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_multi_tenant_mode_says_what_the_operator_keys_open(caplog, tmp_path):
    """Found by an operator walkthrough: the start-up line did not say whether the console and
    /metrics could be reached at all."""
    from kvfence.server.serve import load_tenants

    path = tmp_path / "t.toml"
    path.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n")
    with caplog.at_level(logging.INFO):
        load_tenants(str(path))
    assert "console and reload route off (no [operator] key); /metrics closed" in caplog.text
    caplog.clear()
    path.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n[operator]\napi_keys = ['sk-operator-1']\n")
    with caplog.at_level(logging.INFO):
        load_tenants(str(path))
    assert "console and reload route on ([operator] key); /metrics for the [operator] key only" in caplog.text


def test_a_minute_budget_without_a_default_answer_length_is_pointed_out(caplog, tmp_path):
    """Found by a parity probe: at tokens_per_minute 1000, chat requests that set no
    max_tokens (most clients) reserved the whole minute and got 429 for a minute after one of
    ~100 tokens. Valid, and as documented; the start-up log now says so (not on a node, which
    applies no tenant limit)."""
    from kvfence.server.serve import load_tenants

    path = tmp_path / "t.toml"
    path.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\ntokens_per_minute = 1000\n"
                    "[tenants.b]\napi_keys = ['sk-bbbbbbbb']\ntokens_per_minute = 1000\ndefault_max_tokens = 200\n")
    with caplog.at_level(logging.INFO):
        load_tenants(str(path))
    notes = [r.message for r in caplog.records if "no default_max_tokens" in r.message]
    assert len(notes) == 1 and "tenant 'a' has tokens_per_minute 1000" in notes[0], caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        load_tenants(str(path), node=True)
    assert "no default_max_tokens" not in caplog.text


def test_max_prompt_tokens_per_tenant(server):
    ok = server.client("capped").completions.create(model=MODEL, prompt="Hi there", max_tokens=2)
    assert ok.usage.prompt_tokens <= 16
    with pytest.raises(openai.BadRequestError) as e:
        server.client("capped").completions.create(model=MODEL, prompt="word " * 40, max_tokens=2)
    assert e.value.code == "tenant_max_prompt_tokens" and "16" in e.value.message and "40" in e.value.message
    # the same prompt is fine for a tenant without the cap
    assert server.client("alice").completions.create(model=MODEL, prompt="word " * 40, max_tokens=2).usage
    # chat names its messages (found by a walkthrough: it said 'prompt')
    with pytest.raises(openai.BadRequestError) as e:
        server.client("capped").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w " * 40}],
                                                        max_tokens=2)
    assert e.value.code == "tenant_max_prompt_tokens" and e.value.param == "messages"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_text_surely_over_the_tenants_cap_is_refused_by_that_cap_before_tokenizing(server, monkeypatch, kind):
    """Found by a walkthrough: a tenant capped at 16 prompt tokens sending 1.2M characters was
    told that 8190 tokens fit beside max_tokens (the context's bound, the only one checked
    before tokenizing). Its own cap refuses it now, before any tokenizing. Mutant: no cap in
    the pre-tokenizing bound."""
    tok = server.engine.tokenizer
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("tokenized a text surely over the cap"))
    monkeypatch.setattr(tok, "encode_rendered", lambda *a, **k: pytest.fail("tokenized a text surely over the cap"))
    c = server.client("capped")
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 200_000}], max_tokens=2)
        else:
            c.completions.create(model=MODEL, prompt="x" * 200_000, max_tokens=2)
    assert e.value.code == "tenant_max_prompt_tokens" and "at most 16 prompt tokens" in e.value.message
    assert "characters are at least" in e.value.message   # the rendered conversation's, for chat
    # the key's own context, in the words clients tell a context overflow by (LiteLLM)
    assert e.value.body["message"].startswith("This model's maximum context length is 16 prompt tokens for this API "
                                              "key")


def test_max_concurrent_requests_gives_429_and_others_keep_going(server):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with server.http("solo") as h:
        with h.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            events = held.iter_lines()    # keep a reference: a collected iterator closes the connection
            assert next(events).startswith("data: ")     # first token streamed: the request is running
            with pytest.raises(openai.RateLimitError) as e:
                server.client("solo").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert e.value.status_code == 429 and e.value.code == "tenant_max_concurrent_requests"
            assert e.value.response.headers["retry-after"] == "1"
            # the token-counting routes take a slot too: rendering a chat with tools costs CPU
            t = h.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
            assert t.status_code == 429 and t.json()["error"]["code"] == "tenant_max_concurrent_requests"
            assert h.post("/detokenize", json={"tokens": [1, 2]}).status_code == 429
            # another tenant is served meanwhile
            assert server.client("bob").completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
    # the held stream was closed: its slot comes back
    assert wait_for(lambda: server.state.limiter.in_flight("solo") == 0, 10)
    assert server.client("solo").completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
    with server.http("solo") as h:     # and a slot is given back after each count
        for _ in range(3):
            assert h.post("/tokenize", json={"prompt": "Hi"}).json()["count"] >= 1
    assert server.state.limiter.in_flight("solo") == 0
    assert server.metric("kvfence_admission_rejections_total", reason="tenant_max_concurrent_requests") >= 1


def test_tokens_per_minute_gives_429_with_retry_after(server):
    c = server.client("metered")
    # a request that may use more than the whole minute's budget (prompt + max_tokens > 60)
    # could never pass: 400, and it takes nothing from the budget
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=100)
    assert e.value.code == "tenant_tokens_per_minute" and server.state.limiter.tokens_in_window("metered") == 0
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=52, temperature=0,
                             extra_body={"ignore_eos": True})
    used = r.usage.total_tokens
    assert used == r.usage.prompt_tokens + 52 and 52 < used <= 60
    assert server.state.limiter.tokens_in_window("metered") == used
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)   # its headers: the
    left = 60 - used - raw.parse().usage.prompt_tokens - 1   # minute's tokens, reserved ones too; no request limit
    assert {k: v for k, v in raw.headers.items() if k.startswith("x-ratelimit-")} == {
        "x-ratelimit-limit-tokens": "60", "x-ratelimit-remaining-tokens": str(left), "x-ratelimit-reset-tokens": "60s"}
    used = server.state.limiter.tokens_in_window("metered")
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt="The capital of Spain is a city called", max_tokens=2)  # 8 tokens
    assert e.value.code == "tenant_tokens_per_minute" and "60" in e.value.message
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    assert e.value.response.headers["x-ratelimit-remaining-tokens"] == str(60 - used)
    raw = server.client("alice").completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert raw.parse().usage and not [k for k in raw.headers if k.startswith("x-ratelimit-")]   # no per-minute limits


def test_a_request_refused_after_a_choice_generated_pays_for_what_it_made(make_server, monkeypatch):
    """A later choice refused once an earlier one has generated (behind the PD router a
    choice waits on decode for pages while the first one runs) refuses the request, and the
    tenant's minute keeps the tokens the engine made: a full refund let a client have tokens
    generated for free. The real handler and engine; the follower's submit is held until the
    lead has made some tokens, then refused as a full queue is."""
    from kvfence.engine.admission import Overloaded

    srv = make_server(tenants=TENANTS_TOML_WITH_BILLED)
    engine, made = srv.state.engine, {}
    submit = engine.submit

    async def held_submit(ids, params, tenant, rid, *a, after=None, **kw):
        if after is None:
            made[rid] = handle = await submit(ids, params, tenant, rid, *a, after=after, **kw)
            return handle
        lead = made[after]
        for _ in range(500):   # bounded: 10 s
            if lead.updates.qsize() >= 3:
                break
            await asyncio.sleep(0.02)
        raise Overloaded("The server is overloaded: its queue is full; retry shortly.")

    monkeypatch.setattr(engine, "submit", held_submit)
    c = srv.client("sk-billed-0001")
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=40, n=2,
                             temperature=0.8, extra_body={"ignore_eos": True})
    assert e.value.status_code == 503 and e.value.code == "server_overloaded"
    prompt = len(srv.engine.tokenizer.encode("The capital of France is"))
    assert wait_for(lambda: srv.state.limiter.in_flight("billed") == 0, 10)
    used = srv.state.limiter.tokens_in_window("billed")
    assert prompt + 3 <= used < prompt + 2 * 40, (prompt, used)   # what the lead made, not all, not nothing


def test_requests_per_minute_gives_429_and_counts_only_what_it_takes(make_server):
    """A flood of cheap requests (tiny, or hung up at once) stays under tokens_per_minute and
    still costs a parse and a tokenize each (behind a PD router, a prefill and a handoff):
    requests_per_minute bounds it. Every route that takes a slot counts; a refusal does not
    (a client retrying a 429 in a loop does not push its wait further out); another tenant is
    not touched."""

    srv = make_server(tenants=TENANTS_TOML + '\n[tenants.paced]\napi_keys = ["sk-paced-00001"]\n'
                      'requests_per_minute = 3\n')
    c = srv.client("sk-paced-00001")
    assert c.models.list().data[0].model_dump()["tenant_limits"]["requests_per_minute"] == 3
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert raw.parse().usage   # OpenAI's headers, this request counted; no tokens_per_minute: no token headers
    assert {k: v for k, v in raw.headers.items() if k.startswith("x-ratelimit-")} == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "60s"}
    with srv.http("sk-paced-00001") as h:
        assert h.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1).usage
    for _ in range(3):   # refused: counted nowhere, so the wait does not grow
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert e.value.code == "tenant_requests_per_minute" and "3 requests per minute" in e.value.message
        assert 55 <= int(e.value.response.headers["retry-after"]) <= 60
        assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    with srv.http("sk-paced-00001") as h:
        r = h.post("/detokenize", json={"tokens": [1, 2]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_requests_per_minute"
    assert srv.state.limiter.requests_in_window("paced") == 3 and srv.state.limiter.in_flight("paced") == 0
    assert srv.client("alice").completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage
    # the generation requests refused (the count routes' refusals are not admissions: as for concurrency)
    assert srv.metric("kvfence_admission_rejections_total", reason="tenant_requests_per_minute") == 3


def test_limiter_requests_per_minute_window():
    now = [1000.0]
    lim = TenantLimiter(clock=lambda: now[0])
    t = Tenant("t", Limits(requests_per_minute=2, max_concurrent_requests=1))
    lim.hold(t).release()
    now[0] += 20
    a = lim.hold(t)
    with pytest.raises(APIError) as e:         # the concurrency slot is refused first: not counted
        lim.hold(t)
    assert e.value.code == "tenant_max_concurrent_requests" and lim.requests_in_window("t") == 2
    a.release()
    with pytest.raises(APIError) as e:         # 2 in the last minute; the first leaves it in 40 s
        lim.hold(t)
    assert e.value.status == 429 and e.value.code == "tenant_requests_per_minute"
    assert e.value.headers["Retry-After"] == "40"
    now[0] += 40                               # the first has left the window: one more fits
    lim.hold(t).release()
    with pytest.raises(APIError):
        lim.hold(t)
    lim.forget(["t"])                          # a retired name starts with an empty window
    assert lim.requests_in_window("t") == 0
    lim.hold(t).release()
    assert lim.requests_in_window("t") == 1
    assert lim.requests_in_window("unlimited") == 0


def test_a_request_without_max_tokens_fits_its_tenants_budget(make_server):
    """Found by an operator walkthrough: a chat request without max_tokens (what most clients
    send) reserved the rest of the context, so a tenant whose tokens_per_minute was below the
    context got a 400 it could not fix. Such a request is now limited by the tenant's
    default_max_tokens, and never beyond what an empty minute of its budget holds; one that
    sets max_tokens is taken as it is."""

    srv = make_server(tenants=TENANTS_TOML + '\n[tenants.brief]\napi_keys = ["sk-brief-00001"]\n'
                      'default_max_tokens = 5\n')
    ask = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
    r = srv.client("metered").chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 60, r.usage
    brief = srv.client("sk-brief-00001").chat.completions
    r = brief.create(model=MODEL, messages=ask, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = brief.create(model=MODEL, messages=ask, max_tokens=9, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9
    r = brief.create(model=MODEL, messages=ask, n=2, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length", "length"] and r.usage.completion_tokens == 10
    # a Response says the limit that ended it, not null
    r = srv.client("sk-brief-00001").responses.create(model=MODEL, input=ask[0]["content"],
                                                      extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.max_output_tokens == 5 and r.usage.output_tokens == 5
    # completions keep OpenAI's own default of 16 when max_tokens is not sent
    r = srv.client("sk-brief-00001").completions.create(model=MODEL, prompt="Once", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_limiter_reserves_prompt_plus_max_tokens_and_refunds_the_rest():
    """tokens_per_minute holds the most a request can use while it runs (so N concurrent
    requests cannot each take the whole budget) and keeps only what it used."""
    now = [1000.0]
    lim = TenantLimiter(clock=lambda: now[0])
    t = Tenant("t", Limits(tokens_per_minute=300))
    a = lim.admit(t, 20, 200)                  # 220 reserved
    with pytest.raises(APIError) as e:         # 220 + 100 > 300 while a runs
        lim.admit(t, 20, 80)
    assert e.value.status == 429 and e.value.code == "tenant_tokens_per_minute"
    a.release(completion_tokens=30)            # a used 50: 170 refunded
    assert lim.tokens_in_window("t") == 50
    b = lim.admit(t, 20, 80)
    b.release(completion_tokens=80)
    assert lim.tokens_in_window("t") == 150
    with pytest.raises(APIError) as e:         # alone more than the whole minute's budget: never, so 400
        lim.admit(t, 100, 201)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    now[0] += 61
    assert lim.tokens_in_window("t") == 0


def test_limiter_window_slides():
    now = [1000.0]
    lim = TenantLimiter(clock=lambda: now[0])
    t = Tenant("t", Limits(tokens_per_minute=100, max_concurrent_requests=2))
    a = lim.admit(t, 50, 30)
    a.release(completion_tokens=30)            # 80 used
    with pytest.raises(APIError) as e:
        lim.admit(t, 30)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "60"
    now[0] += 61                               # the window has moved past both entries
    b, c = lim.admit(t, 30), lim.admit(t, 30)
    with pytest.raises(APIError) as e:
        lim.admit(t, 1)
    assert e.value.code == "tenant_max_concurrent_requests"
    b.release()
    b.release()                                # releasing twice frees one slot only
    assert lim.in_flight("t") == 1
    c.release()
    assert lim.in_flight("t") == 0


def test_keys_and_prompts_are_never_logged(server, caplog):
    secret_prompt = "zebra-quartz-4417 is my password"
    with caplog.at_level(logging.DEBUG):
        r = server.client("bob").completions.create(model=MODEL, prompt=secret_prompt, max_tokens=16,
                                                    extra_body={"ignore_eos": True})
        list(server.client("bob").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": secret_prompt}], max_tokens=3, stream=True))
        with pytest.raises(openai.AuthenticationError):
            server.client("sk-leaked-key-123").completions.create(model=MODEL, prompt=secret_prompt, max_tokens=3)
        time.sleep(0.2)
    # the server's own logs (the openai client's debug log, in this process too, is not the server's)
    text = "\n".join(rec.getMessage() for rec in caplog.records if rec.name.startswith(("kvfence", "uvicorn")))
    assert "POST /v1/completions" in text                                     # access log captured too
    assert r.id in text and "tenant=bob" in text and "prompt_tokens=" in text   # counts are logged
    for secret in ("zebra", "quartz", "password", KEYS["bob"], "sk-leaked-key-123"):
        assert secret not in text, secret
    completion = r.choices[0].text.strip()
    if len(completion) >= 20:          # long enough not to occur in a log line by chance
        assert completion not in text


# -- the tenants file ------------------------------------------------------------------------

def test_tenants_file_round_trip(tmp_path):
    import hashlib

    p = tmp_path / "tenants.toml"
    digest = hashlib.sha256(b"sk-hashed-key-1").hexdigest()
    p.write_text(f"""
[defaults]
tokens_per_minute = 1000

[tenants.acme]
api_keys = ["sk-acme-key-1"]
max_prompt_tokens = 512

[tenants.globex]
api_key_sha256 = ["{digest}"]
tokens_per_minute = 5
""")
    reg = TenantRegistry.from_file(p)
    assert not reg.single_tenant
    acme = reg.authenticate("Bearer sk-acme-key-1")
    assert acme.name == "acme" and acme.limits == Limits(512, None, 1000)
    globex = reg.authenticate("bearer   sk-hashed-key-1")
    assert globex.name == "globex" and globex.limits.tokens_per_minute == 5
    for bad in (None, "", "Bearer", "Bearer sk-acme-key-2", "sk-acme-key-1", "Basic sk-acme-key-1"):
        with pytest.raises(APIError) as e:
            reg.authenticate(bad)
        assert e.value.status == 401


@pytest.mark.parametrize("toml,fragment", [
    ("[tenants.a]\napi_keys = []\n", "needs api_keys"),
    ("[tenants.a]\napi_keys = ['short']\n", "shorter than 8"),
    ("[tenants.a]\napi_keys = ['sk-same-key-1']\n[tenants.b]\napi_keys = ['sk-same-key-1']\n", "also given"),
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\nmax_concurrent_requests = 0\n", "positive integer"),
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\ndefault_max_tokens = 0\n", "default_max_tokens must be a positive"),
    ("[defaults]\ndefault_max_tokens = '5'\n[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n", "positive integer"),
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\nmax_concurent_requests = 3\n", "unknown field"),
    ("[tenants.'bad name']\napi_keys = ['sk-aaaaaaaa']\n", "tenant names"),
    ("[tenant.a]\napi_keys = ['sk-aaaaaaaa']\n", "unknown top-level"),
    ("", "no tenants"),
    ("[tenants.a\n", "not valid TOML"),
    ("[tenants.a]\napi_keys = ['sk-same-key-1']\n[metrics]\napi_keys = ['sk-same-key-1']\n", "also tenant 'a'"),
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n[metrics]\napi_keys = ['sk-bbbbbbbb']\nrole = 'x'\n",
     r"\[metrics\]: a table with api_keys"),
    # a scraper's key must not also open the console (the operator key reads /metrics anyway)
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n[operator]\napi_keys = ['sk-same-key-1']\n"
     "[metrics]\napi_keys = ['sk-same-key-1']\n", r"\[metrics\]: its key is also the \[operator\] key"),
    # keys a client can never send as they are written (headers are stripped, ASCII): refused, not dead
    ("[tenants.a]\napi_keys = [' sk-aaaaaaaa']\n", "printable ASCII"),
    ("[tenants.a]\napi_keys = ['sk-aaaaaaaa ']\n", "printable ASCII"),
    ("[tenants.a]\napi_keys = ['sk-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9']\n", "printable ASCII"),
    ('[tenants.a]\napi_keys = ["sk-aaaaaaa\\t"]\n', "printable ASCII"),
    # the label the metrics give requests refused before a tenant is known
    ("[tenants.unauthenticated]\napi_keys = ['sk-aaaaaaaa']\n", "reserved"),
])
def test_bad_tenants_files_are_refused_clearly(tmp_path, toml, fragment):
    p = tmp_path / "t.toml"
    p.write_text(toml)
    with pytest.raises(TenantsFileError, match=fragment) as e:
        TenantRegistry.from_file(p)
    assert "sk-same-key-1" not in str(e.value)       # a key is never echoed back


def test_a_key_with_spaces_inside_still_authenticates():
    # found in review: the printable-ASCII rule at first refused inner spaces, which a Bearer
    # header carries as they are (only the ends are stripped): keys that worked stopped loading
    reg = TenantRegistry.from_dict({"tenants": {"a": {"api_keys": ["sk-aaaa aaaa"]}}})
    assert reg.authenticate("Bearer sk-aaaa aaaa").name == "a"
    assert reg.authenticate("Bearer  sk-aaaa aaaa ").name == "a"


# -- the tenant-scoped prefix cache through the API (I9) -------------------------------------

LONG_PROMPT = ("Our company handbook, section one: every employee receives a laptop, a badge and a desk. "
               "Section two: holidays are requested two weeks ahead. Section three says that")


def test_prefix_cache_hits_within_a_tenant_never_across(make_server):
    srv = make_server()          # a fresh cache
    kw = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=6, temperature=0)
    first = srv.client("alice").completions.create(**kw)
    n = first.usage.prompt_tokens
    assert n >= 33 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = srv.client("alice2").completions.create(**kw)     # alice's other key: same tenant
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (n - 1) // 16 * 16 and cached >= 32          # whole pages, one token left to compute
    assert again.choices[0].text == first.choices[0].text       # identical greedy output from cached KV
    other = srv.client("bob").completions.create(**kw)           # same prompt, another tenant
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].text == first.choices[0].text
    # streaming reports it too
    chunks = list(srv.client("bob").completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached   # bob now hits his own entry
    assert srv.metric("kvfence_prefix_cache_hit_tokens_total") == 2 * cached


def test_public_prefix_scope_is_shared_only_by_tenants_that_opt_in(make_server):
    srv = make_server()
    kw = dict(model=MODEL, prompt=LONG_PROMPT + " the office", max_tokens=3, temperature=0)
    assert srv.client("pub1").completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    assert srv.client("pub2").completions.create(**kw).usage.prompt_tokens_details.cached_tokens >= 32
    assert srv.client("alice").completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    assert _rid_tenant(srv, list(srv.spy.seen)[-1]) == "alice"


def test_public_prefix_scope_in_the_tenants_file(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\npublic_prefix_scope = 'docs-v1'\n"
                 "[tenants.b]\napi_keys = ['sk-bbbbbbbb']\n")
    reg = TenantRegistry.from_file(p)
    assert reg.tenants["a"].public_prefix_scope == "docs-v1" and reg.tenants["b"].public_prefix_scope is None
    p.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\npublic_prefix_scope = 'has space'\n")
    with pytest.raises(TenantsFileError, match="public_prefix_scope"):
        TenantRegistry.from_file(p)


def test_tokenizing_runs_inside_the_tenants_concurrency_slot(server, monkeypatch):
    """Parsing and tokenizing a large body is seconds of CPU: it happens while the request
    holds its tenant's slot, so a tenant with max_concurrent_requests = 1 cannot tokenize two
    bodies at once (before, the slot was taken only after tokenizing)."""
    import threading

    tok = server.state.engine.tokenizer
    entered, go = threading.Event(), threading.Event()
    real = tok.encode

    def slow_encode(text, *a, **kw):
        if "hold me" in text:
            entered.set()
            assert go.wait(30)
        return real(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    first: dict = {}
    t = threading.Thread(target=lambda: first.setdefault("r", server.client("solo").completions.create(
        model=MODEL, prompt="hold me", max_tokens=2)))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(openai.RateLimitError) as e:   # the first one still tokenizes
            server.client("solo").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=2)
        assert e.value.code == "tenant_max_concurrent_requests"
        assert server.state.limiter.in_flight("solo") == 1
    finally:
        go.set()
        t.join(60)
    assert first["r"].usage.completion_tokens >= 1
    assert server.state.limiter.in_flight("solo") == 0     # and it went back


@pytest.mark.parametrize("where", ["tokenizer", "formatter"])
def test_a_slot_goes_back_when_the_request_fails_before_it_is_answered(server, monkeypatch, caplog, where):
    """A failure that is not a refusal (a bug in the template, say) still frees the slot. The
    last step before the answer (building the run that formats it) came after the block that
    frees the slot on failure: a bug there left the slot held for good and the engine
    generating for nobody. The 500 is counted, and logged with where it was raised (it was
    logged by its type alone) but not with its message, which may quote the client."""
    from kvfence.server import app as app_mod

    said = f"injected {where} bug, quoting the prompt"   # not on the line raising it, which is logged

    def broken(*a, **kw):
        raise RuntimeError(said)

    if where == "tokenizer":
        monkeypatch.setattr(server.state.engine.tokenizer, "encode", broken)
    else:
        monkeypatch.setattr(app_mod, "Formatter", broken)
    failed = server.metric("kvfence_request_failures_total", code="internal_error")
    with caplog.at_level(logging.ERROR, logger="kvfence.server"):
        r = server.http("solo").post("/v1/completions", json={"prompt": "x", "max_tokens": 200})
    assert r.status_code == 500
    rid = r.headers["x-request-id"]
    logged = [x.getMessage() for x in caplog.records if rid in x.getMessage()]
    assert len(logged) == 1 and "unhandled RuntimeError" in logged[0], logged
    assert "in broken" in logged[0] and "quoting the prompt" not in logged[0], logged[0]
    assert server.metric("kvfence_request_failures_total", code="internal_error") == failed + 1
    assert server.state.limiter.in_flight("solo") == 0
    assert wait_for(lambda: not server.state.engine.snapshot.get("running"))   # aborted at the next step


def test_a_prompt_far_too_long_is_refused_before_it_is_tokenized(server, monkeypatch):
    """Its length alone proves it cannot fit (the vocabulary's longest token is
    max_token_chars characters): 400 context_length_exceeded without tokenizing it."""
    tok = server.state.engine.tokenizer
    calls: list[int] = []
    real = tok.encode

    def counting(text, *a, **kw):
        calls.append(len(text))
        return real(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", counting)
    usable = server.state.facts["usable_context"]
    huge = "#" * (usable * tok.max_token_chars + 1)    # the one text whose tokens are longest, and still too long
    assert len(huge) < 256 << 10
    with pytest.raises(openai.BadRequestError) as e:
        server.client("bob").completions.create(model=MODEL, prompt=huge, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt" and "characters" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        server.client("bob").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}],
                                                      max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert calls == []
    assert server.state.limiter.in_flight("bob") == 0
    # at the bound (max_tokens 1 leaves usable - 1) it is tokenized, and the exact check refuses it
    with pytest.raises(openai.BadRequestError) as e:
        server.client("bob").completions.create(model=MODEL, prompt="#" * ((usable - 1) * tok.max_token_chars),
                                                max_tokens=1)
    assert e.value.code == "context_length_exceeded" and "in the prompt" in e.value.message
    assert len(calls) == 1
