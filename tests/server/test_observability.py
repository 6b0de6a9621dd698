"""/health, /metrics, the isolation statement (endpoint and CLI), and an isolation check
firing through the HTTP API: the request fails closed and the violation is counted."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from server_harness import KEYS, MODEL, SCRAPER_KEY, TENANTS_TOML, wait_for

from kvfence.cli import main as cli_main
from kvfence.kv.pool import page_bytes

FAMILIES = ["kvfence_requests", "kvfence_prompt_tokens", "kvfence_generation_tokens",
            "kvfence_time_to_first_token_seconds", "kvfence_inter_token_latency_seconds", "kvfence_queue_wait_seconds",
            "kvfence_requests_running", "kvfence_requests_waiting", "kvfence_kv_pages",
            "kvfence_admission_rejections", "kvfence_isolation_violations", "kvfence_engine_ready",
            "kvfence_prefill_cap_tokens", "kvfence_tokens_computed", "kvfence_preemptions"]


def test_health_reports_ready_and_load(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["ready"] is True
    assert httpx.get(server.url + "/health/live").json()["alive"] is True
    # load balancers' checks often send HEAD (it was a 405)
    assert [httpx.head(server.url + p).status_code for p in ("/health", "/health/live")] == [200, 200]
    # the live counts follow every tenant's load: the [metrics] key reads them, a probe without a
    # key or a tenant's key does not (an attacker probe watched others' activity through them)
    scraper = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}).json()
    assert scraper["running"] == 0 and scraper["waiting"] == 0
    tenant = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEYS['bob']}"}).json()
    assert not {"running", "waiting"} & (body.keys() | tenant.keys()), (body, tenant)


def test_metrics_families_and_values_follow_requests(server):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert set(FAMILIES) <= names, set(FAMILIES) - names
    before = server.metrics()
    get = lambda m, k, **l: m.get((k, frozenset(l.items())), 0.0)  # noqa: E731
    r = server.client("bob").completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        server.client("bob").completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    server.wait_idle()
    after = server.metrics()
    assert get(after, "kvfence_requests_total", tenant="bob", outcome="length") == \
        get(before, "kvfence_requests_total", tenant="bob", outcome="length") + 1
    assert get(after, "kvfence_requests_total", tenant="bob", outcome="rejected") == \
        get(before, "kvfence_requests_total", tenant="bob", outcome="rejected") + 1
    assert get(after, "kvfence_generation_tokens_total", tenant="bob") == \
        get(before, "kvfence_generation_tokens_total", tenant="bob") + 6
    assert get(after, "kvfence_prompt_tokens_total", tenant="bob") == \
        get(before, "kvfence_prompt_tokens_total", tenant="bob") + r.usage.prompt_tokens
    # a prompt shorter than a page hits no cache; the last generated token is never computed
    assert get(after, "kvfence_tokens_computed_total") == \
        get(before, "kvfence_tokens_computed_total") + r.usage.prompt_tokens + 6 - 1
    assert get(after, "kvfence_admission_rejections_total", reason="context_length_exceeded") == \
        get(before, "kvfence_admission_rejections_total", reason="context_length_exceeded") + 1
    # latency by tenant: bob's request counts under bob, none under alice
    for name, n in (("kvfence_time_to_first_token_seconds_count", 1), ("kvfence_inter_token_latency_seconds_count", 5),
                    ("kvfence_request_duration_seconds_count", 1), ("kvfence_queue_wait_seconds_count", 1)):
        assert get(after, name, tenant="bob") == get(before, name, tenant="bob") + n, name
        assert get(after, name, tenant="alice") == get(before, name, tenant="alice"), name

    def grew(name):
        return get(after, name, tenant="bob") - get(before, name, tenant="bob")
    # the wait to run is part of the time to the first token (the refused request ran nothing)
    assert 0 < grew("kvfence_queue_wait_seconds_sum") <= grew("kvfence_time_to_first_token_seconds_sum")
    total = server.engine.facts["pool_pages"]
    assert get(after, "kvfence_kv_pages", state="free") + get(after, "kvfence_kv_pages", state="shared") == total
    assert total == get(after, "kvfence_kv_pages_total")
    assert get(after, "kvfence_kv_pages", state="used") == 0
    assert get(after, "kvfence_isolation_violations_total", invariant="I2") == 0
    assert get(after, "kvfence_requests_running") == 0 and get(after, "kvfence_engine_ready") == 1
    cap = get(after, "kvfence_prefill_cap_tokens")   # sized to the step target, in pages, at most the 256 ceiling
    assert 16 <= cap <= 256 and cap % 16 == 0


def test_the_engine_info_says_what_runs_the_model(server):
    """kvfence_engine_info: one series, labelled with what the engine itself reports running it (an
    image whose user could not write its kernels' folder ran plain torch ops with nothing to show)."""
    info = [dict(labels) for (name, labels), v in server.metrics().items() if name == "kvfence_engine_info" and v == 1]
    assert len(info) == 1, info
    assert {k: info[0][k] for k in ("model", "dtype", "weights", "device", "kernels")} == {
        "model": server.engine.facts["model_name"], "dtype": "bfloat16", "weights": "bf16", "device": "cpu",
        "kernels": "loaded"}, info
    assert info[0]["compute"] == "fused CPU kernels, one-call decoder stack"
    assert info[0]["matmul"] == server.engine.facts["matmul"]


def test_running_gauge_and_used_pages_while_a_request_runs(server):
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with server.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
        events = r.iter_lines()
        assert next(events).startswith("data: ")
        m = server.metrics()
        assert m[("kvfence_requests_running", frozenset())] == 1
        assert m[("kvfence_kv_pages", frozenset({("state", "used")}))] >= 1
    server.wait_idle()


def test_isolation_statement_reflects_the_live_config(server):
    st = server.client().get("/kvfence/isolation", cast_to=object)
    facts = server.engine.facts
    iso = st["kv_memory_isolation"]
    assert iso["scrub_policy"]["policy"] == "zero" and "zeros" in iso["scrub_policy"]["meaning"]
    assert iso["read_checks_before_every_forward_pass"] is True
    pc = iso["prefix_cache"]
    assert pc["enabled"] is True and "per tenant" in pc["scope"]
    assert "volume" in pc["eviction"] and "never their content" in pc["eviction"]   # what the shared pool shows
    # a tenant learns its own sharing, not how many others opted in (found in review)
    assert pc["cross_tenant_sharing"] == "explicit opt-in only: your tenant has not opted in, so none of its pages " \
                                        "is shared"
    whole = server.state.statement()
    assert whole["kv_memory_isolation"]["prefix_cache"]["cross_tenant_sharing"].startswith(
        "explicit opt-in only: 2 tenant(s) share 1 declared public")
    pub = server.client("pub1").get("/kvfence/isolation", cast_to=object)
    assert "'shared-docs'" in pub["kv_memory_isolation"]["prefix_cache"]["cross_tenant_sharing"]
    # what a member of a scope exposes is said where the opt-in is (an attacker probe confirmed a
    # guess of another member's earlier answer, sent back in its next turn, through cached_tokens)
    for sharing in (pub, whole):
        assert "earlier answers sent back" in sharing["kv_memory_isolation"]["prefix_cache"]["cross_tenant_sharing"]
    assert server.client("capped").get("/kvfence/isolation", cast_to=object)["capacity"]["your_prompt_cap"] == 16
    assert iso["tenancy"] == {"mode": "multi-tenant", "identity": iso["tenancy"]["identity"],
                              "who_sees_tenant_names": iso["tenancy"]["who_sees_tenant_names"]}
    # a tenant's view: how many other tenants there are is the operator's to know (console, CLI)
    assert st["audience"] == "tenant"
    assert server.state.statement()["kv_memory_isolation"]["tenancy"]["tenants_configured"] == 7
    assert "API key" in iso["tenancy"]["identity"]
    assert "[metrics]" in iso["tenancy"]["who_sees_tenant_names"]
    cap = st["capacity"]
    assert cap["advertised_context_tokens"] == 1440 == facts["usable_context"]
    assert cap["pools"][0]["capacity_tokens"] == 1440 and cap["pools"][0]["pages"] == 90
    assert cap["pools"][0]["advertised_context_fits"] is True
    assert cap["clamped_to_pool"] is True and cap["model_max_context_tokens"] == 8192
    assert "context_length_exceeded" in cap["request_that_does_not_fit"]
    assert "per_tenant_prompt_caps" not in cap and cap["your_prompt_cap"] is None   # the others' caps: operator's
    assert whole["capacity"]["per_tenant_prompt_caps"] == [16]
    dh = st["data_handling"]
    assert dh["prompt_text_logged"] is False and dh["prompt_text_stored"] is False and dh["api_keys_logged"] is False
    checks = {c["name"]: c for c in st["startup_checks"]}
    assert set(checks) == {"capacity", "read checks before every forward pass", "fault injection", "warm-up request",
                           "scrub on free"}
    assert all(c["status"] == "passed" for c in checks.values())
    assert "read back as zero" in checks["scrub on free"]["detail"]
    assert st["model"]["served_name"] == MODEL and st["model"]["fingerprint"] == facts["fingerprint"]
    assert st["live"]["pages_quarantined"] == 0


def test_the_isolation_statement_walks_the_tenants_once_per_registry(server, monkeypatch):
    """Found in review: any tenant may read the statement, and each read walked every tenant
    on the event loop (~50 ms at 100K tenants). It walks them once per registry now."""
    walks = []

    class Counted(dict):
        def values(self):
            walks.append(1)
            return super().values()

    reg = server.state.tenants
    monkeypatch.setattr(reg, "tenants", Counted(reg.tenants))
    reg.__dict__.pop("facts", None)   # as a registry a reload just made
    for _ in range(3):
        st = server.client("alice").get("/kvfence/isolation", cast_to=object)
        assert "your_prompt_cap" in st["capacity"]
    assert len(walks) == 3   # one walk for each of the three facts, on the first read only


def test_isolation_cli_prints_the_same_statement(server, capsys):
    assert cli_main(["isolation", "--url", server.url, "--api-key", KEYS["alice"]]) == 0
    printed = json.loads(capsys.readouterr().out)
    live = server.client().get("/kvfence/isolation", cast_to=object)
    for part in ("kv_memory_isolation", "capacity", "data_handling", "startup_checks", "model"):
        assert printed[part] == live[part]


def test_isolation_cli_from_config_reflects_scrub_and_pool(loaded_fp32, monkeypatch, capsys, tmp_path):
    from kvfence.engine import llm_engine

    monkeypatch.setattr(llm_engine.LoadedModel, "load", classmethod(lambda cls, cfg: loaded_fp32))
    tenants = tmp_path / "t.toml"
    tenants.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\nmax_prompt_tokens = 100\n")
    rc = cli_main(["isolation", "--dtype", "float32", "--kv-cache-memory", "32MiB", "--clamp-context",
                   "--scrub", "poison", "--tenants", str(tenants)])
    assert rc == 0
    st = json.loads(capsys.readouterr().out)
    assert st["kv_memory_isolation"]["scrub_policy"]["policy"] == "poison"
    pages = (32 << 20) // page_bytes(loaded_fp32.model.config, 16, torch.float32) - 1    # one is the null page
    assert st["capacity"]["pools"][0]["capacity_tokens"] == st["capacity"]["advertised_context_tokens"] == pages * 16
    assert st["capacity"]["pools"][0]["pages"] == pages and st["capacity"]["clamped_to_pool"] is True
    assert st["capacity"]["per_tenant_prompt_caps"] == [100]
    assert st["kv_memory_isolation"]["tenancy"]["mode"] == "multi-tenant"
    assert st["kv_memory_isolation"]["prefix_cache"]["cross_tenant_sharing"] == "none: no tenant has opted in"
    scrub = next(c for c in st["startup_checks"] if c["name"] == "scrub on free")
    assert scrub["status"] == "passed" and "as poison" in scrub["detail"]


def test_isolation_cli_refuses_a_context_the_pool_cannot_hold(loaded_fp32, monkeypatch, capsys):
    from kvfence.engine import llm_engine

    monkeypatch.setattr(llm_engine.LoadedModel, "load", classmethod(lambda cls, cfg: loaded_fp32))
    assert cli_main(["isolation", "--dtype", "float32", "--kv-cache-memory", "16MiB"]) == 2
    assert "exceeds the KV pool capacity" in capsys.readouterr().err


def test_isolation_violation_fails_closed_through_the_api(make_server):
    """Corrupt one request's block table inside the engine (a stale epoch on its first page):
    the I2 check aborts it, the client gets an error (never a 200), the page is quarantined,
    the violation is counted, and another tenant's concurrent request is untouched."""
    srv = make_server()
    c_bob = srv.client("bob")
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    clean = c_bob.completions.create(**kw).choices[0].text
    srv.spy.fault_tenants.add("alice")
    results = {}

    def bystander():
        results["bob"] = c_bob.completions.create(**kw).choices[0].text

    t = threading.Thread(target=bystander)
    t.start()
    with pytest.raises(openai.InternalServerError) as e:
        srv.client("alice").completions.create(**kw)
    t.join(60)
    assert e.value.status_code == 500 and e.value.code == "isolation_violation"
    assert "isolation check I2 failed" in e.value.message
    assert "owner request" not in e.value.message and "scope" not in e.value.message   # another owner's ids
    assert results["bob"] == clean
    snap = srv.wait_idle()
    assert snap["pages_quarantined"] == 1 and snap["pages_owned"] == 0
    assert snap["pages_free"] + snap["pages_shared"] + 1 == snap["pages_total"]
    assert srv.metric("kvfence_isolation_violations_total", invariant="I2") == 1
    assert srv.metric("kvfence_kv_pages", state="quarantined") == 1
    assert srv.metric("kvfence_requests_total", tenant="alice", outcome="error") == 1
    # streaming: the error arrives as an error event, and the client raises
    srv.spy.fault_tenants.add("alice")
    with pytest.raises(openai.APIError) as e:
        for _ in srv.client("alice").completions.create(stream=True, **kw):
            pass
    assert "isolation check I2 failed" in str(e.value)
    assert srv.metric("kvfence_isolation_violations_total", invariant="I2") == 2
    assert srv.client("bob").completions.create(**kw).choices[0].text == clean


def test_http_bench_against_the_server(single, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "--url", single.url, "--num-requests", "4", "--concurrency", "2",
                   "--prompt-tokens", "12", "--output-tokens", "5", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["ok"] == 4 and report["errors"] == {}
    assert report["output_tokens"] == 20 and report["prompt_tokens"] >= 4 * 12
    assert report["model"] == MODEL and report["concurrency"] == 2
    assert 0 < report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["itl_ms"]["p50"] > 0 and report["output_tps"] > 0
    assert "TTFT" in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # README: every timed bench draws one


def _scrape(srv, key: str | None, forwarded_for: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if forwarded_for:
        headers["X-Forwarded-For"] = forwarded_for
    return httpx.get(srv.url + "/metrics", headers=headers, timeout=30)


def test_metrics_name_tenants_only_to_the_scraper_or_operator_key(make_server):
    """/metrics names every tenant and counts its tokens: with a tenants file, no key, a tenant's
    key or a wrong one get a 401 that names no tenant; the [metrics] and [operator] keys read it."""
    operator = "sk-operator-for-metrics"
    srv = make_server(tenants=TENANTS_TOML + f'\n[operator]\napi_keys = ["{operator}"]\n')
    srv.client("bob").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    for key in (None, KEYS["alice"], KEYS["bob"], "sk-not-a-key", SCRAPER_KEY + "x"):
        r = _scrape(srv, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (key, r.text)
        assert "bob" not in r.text and "alice" not in r.text and "[metrics]" in r.text
    for key in (SCRAPER_KEY, operator):
        r = _scrape(srv, key)
        assert r.status_code == 200 and 'tenant="bob"' in r.text
        # and the isolation statement whole, as `kvfence isolation --api-key` asks for it (an
        # operator's walkthrough found both keys refused there)
        st = httpx.get(srv.url + "/v1/kvfence/isolation", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert st.status_code == 200 and "audience" not in st.json(), st.text[:300]
        assert "per_tenant_prompt_caps" in st.json()["capacity"]
    bob = httpx.get(srv.url + "/v1/kvfence/isolation", headers={"Authorization": f"Bearer {KEYS['bob']}"}, timeout=30)
    assert bob.json()["audience"] == "tenant"
    assert httpx.get(srv.url + "/v1/kvfence/isolation", headers={"Authorization": "Bearer sk-nobody"},
                     timeout=30).status_code == 401


def test_metrics_stay_open_without_a_tenants_file(single):
    r = _scrape(single, None)
    assert r.status_code == 200 and "kvfence_kv_pages" in r.text


def test_guessing_the_metrics_key_is_bounded_per_address(make_server):
    """After LIMIT wrong keys from one address, that address gets 429 with Retry-After and even
    the right key is not checked until the window ends; scrapes with no key are not counted."""
    from kvfence.server.auth_throttle import LIMIT

    srv = make_server()
    for _ in range(LIMIT + 5):
        assert _scrape(srv, None).status_code == 401
    assert _scrape(srv, SCRAPER_KEY).status_code == 200
    # nor is a tenant's own key (a client that sends it everywhere): it guesses nothing, and
    # counting it would lock the operator's scraper out of a shared address
    for _ in range(LIMIT + 5):
        assert _scrape(srv, KEYS["alice"]).status_code == 401
    assert _scrape(srv, SCRAPER_KEY).status_code == 200
    for _ in range(LIMIT):
        assert _scrape(srv, "sk-guess-00000").status_code == 401
    r = _scrape(srv, SCRAPER_KEY)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert f"try again in {r.headers['Retry-After']} s" in r.json()["error"]["message"]
    # /health still answers the probe, and says why the scraper's detail is missing (it vanished
    # in silence: a docs probe)
    h = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}, timeout=30)
    assert h.status_code == 200 and "too many wrong keys" in h.json()["detail_withheld"], h.text
    assert not {"running", "waiting", "nodes", "error"} & set(h.json()), h.text   # none of the detail
    t = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=30)
    assert not {"running", "waiting", "nodes", "error"} & set(t.json()), t.text   # nor to a tenant's key


def test_guessing_keys_on_the_isolation_statement_is_bounded_too(make_server):
    """The statement answers the operator's and the scraper's keys whole and a wrong key 401:
    a guesser learned there which key opens the console, without any bound. Its wrong keys
    count with /metrics'; once throttled, the right key is not checked there either (429, not
    a 401 that told the operator its key was wrong), and a tenant behind the same address
    still reads its own part."""
    from kvfence.server.auth_throttle import LIMIT

    srv = make_server()

    def statement(key):
        return httpx.get(srv.url + "/v1/kvfence/isolation", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    for i in range(LIMIT):
        assert statement(f"sk-guess-{i:05d}").status_code == 401
    for key in (SCRAPER_KEY, "sk-guess-more"):   # the right key is not checked, and not told it is wrong
        r = statement(key)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    assert _scrape(srv, SCRAPER_KEY).status_code == 429
    mine = statement(KEYS["alice"])
    assert mine.status_code == 200 and mine.json()["audience"] == "tenant"


def test_a_forwarded_for_header_does_not_move_the_count_to_another_address(make_server):
    """uvicorn believes X-Forwarded-For from loopback unless told not to: a guesser could name a
    new address for each guess (no bound at all) or name the scraper's (locking it out)."""
    from kvfence.server.auth_throttle import LIMIT

    srv = make_server()
    for i in range(LIMIT):
        assert _scrape(srv, "sk-guess-00000", forwarded_for=f"10.8.0.{i}").status_code == 401
    assert _scrape(srv, SCRAPER_KEY).status_code == 429            # counted against the real address
    assert _scrape(srv, SCRAPER_KEY, forwarded_for="10.9.9.9").status_code == 429


def test_tokens_and_latency_count_what_reached_the_client(make_server):
    """Found by an operator's-view probe: a PD node lost after 21 tokens of an unstreamed answer
    counted them (and its TTFT) for a client that got a 503. Here the answers are ended by the
    engine (end_all, as a stopping server ends them): the stream's tokens reached its client and
    count; the unstreamed answer's did not. Mutant: count every answer's tokens."""
    srv = make_server(tenants=None)
    tokens_before = srv.metric("kvfence_generation_tokens_total", tenant="default")
    ttft_before = srv.metric("kvfence_time_to_first_token_seconds_count", tenant="default")
    got: dict = {}
    body = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "temperature": 0}

    def plain():
        with srv.http(None) as c:
            got["plain"] = c.post("/v1/completions", json=body)

    def stream():
        with srv.http(None) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            got["chunks"] = sum(1 for line in r.iter_lines() if line.startswith('data: {"id"'))

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    assert wait_for(lambda: srv.engine.snapshot.get("running") == 2 and srv.engine.in_flight == 2, timeout=60)
    time.sleep(0.5)   # some tokens each
    srv.engine.end_all("server_shutting_down", "ended by the test")
    for t in threads:
        t.join(60)
    assert got["plain"].status_code == 503 and got["chunks"] >= 2, got
    counted = srv.metric("kvfence_generation_tokens_total", tenant="default") - tokens_before
    assert counted == got["chunks"], (counted, got["chunks"])   # the stream's tokens, not the 503's
    assert srv.metric("kvfence_time_to_first_token_seconds_count", tenant="default") == ttft_before + 1


def test_inter_token_gaps_are_each_choices_own():
    from kvfence.server.metrics import ServerMetrics

    m = ServerMetrics(None)
    m.finished("t", "stop", 1, 6, 0.0, 0.1, [[0.1, 1.1, 2.1], [0.6, 1.6, 2.6]])   # n=2, a token a second each
    samples = {s.name: s.value for metric in m.itl.collect() for s in metric.samples}
    assert samples["kvfence_inter_token_latency_seconds_count"] == 4   # merged: 5 gaps of 0.5 s
    assert samples["kvfence_inter_token_latency_seconds_sum"] == pytest.approx(4.0)


def test_an_n2_answer_adds_each_choices_own_gaps(make_server):
    srv = make_server(tenants=None)
    before = srv.metric("kvfence_inter_token_latency_seconds_count", tenant="default")
    with srv.http(None) as c:
        r = c.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 5, "n": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    # 2 x (5 - 1); merged: 9
    assert srv.metric("kvfence_inter_token_latency_seconds_count", tenant="default") == before + 8


def test_every_rejection_reason_is_a_series_from_the_start():
    """server_overloaded appeared only after the first overload: a rate() over it had no past."""
    from kvfence.server.app import _REJECTION_REASON
    from kvfence.server.metrics import REJECTION_REASONS

    assert set(_REJECTION_REASON.values()) <= set(REJECTION_REASONS)
