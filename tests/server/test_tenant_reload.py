"""Reloading the tenants file without a restart (POST /v1/kvfence/tenants/reload with the
operator key, or SIGHUP): a revoked key's requests end at once while everyone else's go on,
a removed tenant's cached prefixes are retired, a rotated operator key locks the old one and
its console cookies out, and a file that does not load changes nothing."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from server_harness import MODEL, pool_intact, wait_for

from kvfence.server.app import ServerState, _reload_on_sighup
from kvfence.server.tenants import Limits, Tenant, TenantLimiter, TenantRegistry, registry_change

OPERATOR = "sk-operator-0001"
ROTATED_OPERATOR = "sk-operator-0002"
SCRAPER = "sk-scraper-0001"
ALICE, ALICE2, BOB = "sk-alice-0001", "sk-alice-0002", "sk-bob-00000001"
FILE = f"""
[tenants.alice]
api_keys = ["{ALICE}", "{ALICE2}"]

[tenants.bob]
api_keys = ["{BOB}"]

[operator]
api_keys = ["{OPERATOR}"]

[metrics]
api_keys = ["{SCRAPER}"]
"""
WITHOUT_BOB = FILE.replace(f'[tenants.bob]\napi_keys = ["{BOB}"]\n', "")
PROMPT = ("Our company handbook, section one: every employee receives a laptop, a badge and a desk. "
          "Section two: holidays are requested two weeks ahead. Section three says that")
LONG = dict(model=MODEL, max_tokens=300, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def tenants_path(tmp_path_factory):
    return tmp_path_factory.mktemp("reload") / "tenants.toml"


@pytest.fixture(scope="module")
def _server(make_server, tenants_path):
    tenants_path.write_text(FILE)
    return make_server(registry=TenantRegistry.from_file(tenants_path))


@pytest.fixture
def srv(_server, tenants_path):
    """The server, with FILE in force again (tests rotate the operator key too)."""
    tenants_path.write_text(FILE)
    assert any(reload(_server, key).status_code == 200 for key in (OPERATOR, ROTATED_OPERATOR))
    return _server


def reload(srv, key: str | None = OPERATOR) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + "/v1/kvfence/tenants/reload", headers=headers, timeout=60)


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


def metric(srv, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPER}"}, timeout=30)
    r.raise_for_status()
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_a_removed_tenants_stream_ends_at_once_and_the_others_go_on(srv, tenants_path):
    bob = client(srv, BOB).chat.completions.create(messages=[{"role": "user", "content": "Count."}], stream=True,
                                                   **LONG)
    alice = client(srv, ALICE).chat.completions.create(messages=[{"role": "user", "content": "Count."}],
                                                       stream=True, **{**LONG, "max_tokens": 40})
    next(bob)
    next(alice)
    revoked_before = metric(srv, "kvfence_requests_total", tenant="bob", outcome="key_revoked")
    tenants_path.write_text(WITHOUT_BOB)
    r = reload(srv)
    assert r.status_code == 200, r.text
    change = r.json()
    assert change["removed"] == ["bob"] and change["added"] == [] and change["keys_revoked"] == 1
    assert change["requests_revoked"] == 1 and change["tenants"] == 1
    assert BOB not in r.text and "sk-" not in r.text          # names and counts, never a key
    with pytest.raises(openai.APIError) as e:
        n = sum(1 for _ in bob)
        pytest.fail(f"bob's stream went on for {n} more chunks after his key was revoked")
    assert e.value.body["code"] == "api_key_revoked", e.value.body
    done = list(alice)
    assert done[-1].choices[0].finish_reason == "length"     # alice's stream never noticed
    with pytest.raises(openai.AuthenticationError):
        client(srv, BOB).models.list()
    assert metric(srv, "kvfence_requests_total", tenant="bob", outcome="key_revoked") == revoked_before + 1
    assert wait_for(lambda: pool_intact(srv.wait_idle())), srv.engine.snapshot


def test_a_rotated_key_ends_its_own_requests_not_the_tenants_others(srv, tenants_path):
    """alice drops her second key: what runs under it stops (unstreamed: a 401 as its answer),
    what runs under her first key finishes, and only the first key works from then on."""
    out: dict = {}

    def ask(name: str, key: str) -> None:
        try:
            out[name] = client(srv, key).completions.create(prompt=PROMPT, **LONG)
        except openai.APIError as e:
            out[name] = e

    threads = [threading.Thread(target=ask, args=a) for a in (("old", ALICE2), ("kept", ALICE))]
    for t in threads:
        t.start()
    assert wait_for(lambda: srv.engine.snapshot.get("running", 0) == 2, timeout=60), srv.engine.snapshot
    tenants_path.write_text(FILE.replace(f'"{ALICE}", "{ALICE2}"', f'"{ALICE}"'))
    change = reload(srv).json()
    assert change["changed"] == ["alice"] and change["removed"] == [] and change["requests_revoked"] == 1
    for t in threads:
        t.join(120)
    assert isinstance(out["old"], openai.AuthenticationError) and out["old"].code == "api_key_revoked", out["old"]
    assert out["kept"].choices[0].finish_reason == "length" and out["kept"].usage.completion_tokens == 300
    with pytest.raises(openai.AuthenticationError):
        client(srv, ALICE2).models.list()
    assert client(srv, ALICE).models.list().data


def test_a_removed_tenants_cached_prefixes_are_retired(srv, tenants_path):
    """A tenant given a removed tenant's name must not attach (or time) the cached pages of the
    prompts the removed one sent."""
    kw = dict(model=MODEL, prompt=PROMPT + " bob", max_tokens=2, temperature=0)
    client(srv, BOB).completions.create(**kw)
    assert client(srv, BOB).completions.create(**kw).usage.prompt_tokens_details.cached_tokens >= 32   # cached
    tenants_path.write_text(WITHOUT_BOB)
    change = reload(srv).json()
    assert change["prefix_pages_retired"] >= 2, change
    new_bob = "sk-another-bob-01"
    tenants_path.write_text(FILE.replace(BOB, new_bob))
    assert reload(srv).json()["added"] == ["bob"]
    assert client(srv, new_bob).completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    assert wait_for(lambda: pool_intact(srv.wait_idle())), srv.engine.snapshot


def test_a_request_revoked_before_it_reaches_the_engine_never_does(srv, tenants_path):
    """Found in review: a body still arriving when the key was revoked went on to the engine,
    ran, and published its prompt into the retired cache scope."""
    seen = len(srv.spy.seen)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + BOB.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body[:20])
        assert wait_for(lambda: srv.state.limiter.in_flight("bob") == 1)     # it holds its slot
        tenants_path.write_text(WITHOUT_BOB)
        assert reload(srv).json()["requests_revoked"] == 1
        sock.sendall(body[20:])
        answer = _read_answer(sock)
    assert answer.startswith("HTTP/1.1 401") and "api_key_revoked" in answer, answer
    assert len(srv.spy.seen) == seen                      # the engine never saw it
    assert "bob" not in srv.engine.snapshot["pages_by_owner"]["shared"]


def test_a_body_completed_after_its_key_was_revoked_is_told_so_before_it_is_judged(srv, tenants_path):
    """The body arrives after the reload that took its key, and is wrong as well: the client
    is told its key was revoked (401), not what is wrong with a body the server never reads:
    a wrong field, or JSON that does not parse (found in review: it got its 400)."""
    for body in (json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": "four"}).encode(), b"{" * 30):
        tenants_path.write_text(FILE)
        assert reload(srv).status_code == 200
        _revoked_while_arriving(srv, tenants_path, body)


def test_a_key_revoked_while_its_prompts_are_tokenized_gets_its_401_not_the_prompts_400(srv, tenants_path,
                                                                                        monkeypatch):
    """Found in review: each prompt of a list is checked for length as soon as it is tokenized,
    and a key revoked meanwhile got that 400 (the body judged after the key was taken)."""
    import kvfence.server.app as app_mod

    tokenize = app_mod._tokenize

    async def revoked_meanwhile(state, *a, **kw):
        ids = await tokenize(state, *a, **kw)
        tenants_path.write_text(WITHOUT_BOB)
        await state.reload_tenants("the test's reload, while tokenizing")
        return ids

    monkeypatch.setattr(app_mod, "_tokenize", revoked_meanwhile)
    too_long = [5] * (srv.state.facts["usable_context"] + 8)
    r = httpx.post(srv.base_url + "/completions", json={"model": MODEL, "prompt": [too_long, [5, 6]], "max_tokens": 2},
                   headers={"Authorization": f"Bearer {BOB}"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked", r.text
    assert srv.state.limiter.in_flight("bob") == 0

    # and a 400 raised by tokenizing itself, once the key was revoked (an empty prompt, a template error)
    from kvfence.server.errors import bad_request

    async def revoked_then_refused(state, *a, **kw):
        await revoked_meanwhile(state, *a, **kw)
        raise bad_request("The prompt is empty after tokenization.", param="prompt")

    tenants_path.write_text(FILE)
    assert reload(srv).status_code == 200
    monkeypatch.setattr(app_mod, "_tokenize", revoked_then_refused)
    r = httpx.post(srv.base_url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {BOB}"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked", r.text


def test_a_node_refusing_a_stale_scope_stamp_is_a_revoked_key_to_the_client(srv, monkeypatch):
    """Behind the PD router a node refuses a request stamped before a retirement it carried out
    (pd/scope_epochs.py): the request's key was revoked by that reload, and the client is told
    so, as by the router's own revocation."""
    from kvfence.server.backend import EngineFailed

    async def stale(*a, **kw):
        raise EngineFailed("tenant 'bob''s cache scope was retired by the router's reload 2", "scope_retired")

    monkeypatch.setattr(srv.state.engine, "submit", stale)
    with pytest.raises(openai.AuthenticationError) as e:
        client(srv, BOB).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.code == "api_key_revoked" and "reload 2" not in e.value.message


def _revoked_while_arriving(srv, tenants_path, body: bytes) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + BOB.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body[:20])
        assert wait_for(lambda: srv.state.limiter.in_flight("bob") == 1)
        tenants_path.write_text(WITHOUT_BOB)
        assert reload(srv).json()["requests_revoked"] == 1
        sock.sendall(body[20:])
        answer = _read_answer(sock)
    assert answer.startswith("HTTP/1.1 401") and "api_key_revoked" in answer, answer
    assert srv.state.limiter.in_flight("bob") == 0


def _read_answer(sock: socket.socket) -> str:
    """One HTTP answer with a Content-Length body (headers and body may come in separate reads)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            data.lower().partition(b"content-length:")[2].split(b"\r\n")[0] or 0):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def test_the_other_choices_of_a_revoked_request_never_run(srv, tenants_path):
    """n > 1: every choice is admitted at once, the others start once the first has run its
    prefill; a key revoked during that prefill ends them all before they run (found in review,
    when the others were submitted on the first's first update: its abort update started them)."""
    out: list = []

    def ask() -> None:
        try:
            out.append(client(srv, BOB).completions.create(prompt=PROMPT, n=3, **LONG))
        except openai.APIError as e:
            out.append(e)

    srv.spy.step_delay = 1.0      # the first choice's prefill step: time to revoke during it
    try:
        before, ran_before = set(srv.spy.seen), set(srv.spy.ran)
        t = threading.Thread(target=ask)
        t.start()
        assert wait_for(lambda: set(srv.spy.seen) - before, timeout=30)
        tenants_path.write_text(WITHOUT_BOB)
        assert reload(srv).json()["requests_revoked"] == 1
        t.join(60)
    finally:
        srv.spy.step_delay = 0.0
    assert isinstance(out[0], openai.AuthenticationError) and out[0].code == "api_key_revoked", out
    admitted = set(srv.spy.seen) - before
    assert len(admitted) == 3, admitted                    # all three at once
    ran = set(srv.spy.ran) - ran_before
    assert ran <= {min(admitted, key=len)}, ran            # the first choice only, if any
    assert wait_for(lambda: pool_intact(srv.wait_idle())), srv.engine.snapshot


def test_a_name_whose_keys_are_all_new_starts_with_an_empty_cache(srv, tenants_path):
    """Every key of a tenant replaced in one reload: another party under the old name (or a
    rotation of every key at once), and the cache goes with the old keys."""
    kw = dict(model=MODEL, prompt=PROMPT + " again", max_tokens=2, temperature=0)
    client(srv, BOB).completions.create(**kw)
    assert client(srv, BOB).completions.create(**kw).usage.prompt_tokens_details.cached_tokens >= 32
    new_bob = "sk-other-bob-001"
    tenants_path.write_text(FILE.replace(BOB, new_bob))
    change = reload(srv).json()
    assert change["changed"] == ["bob"] and change["retired"] == ["bob"] and change["prefix_pages_retired"] >= 2
    assert client(srv, new_bob).completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    # one key kept: the same tenant, cache kept
    tenants_path.write_text(FILE.replace(f'"{BOB}"', f'"{new_bob}", "sk-bob-third-01"'))
    assert reload(srv).json()["retired"] == []
    assert client(srv, new_bob).completions.create(**kw).usage.prompt_tokens_details.cached_tokens >= 32


def test_a_reload_that_drops_the_scrapers_key_says_so_in_the_log(srv, tenants_path, caplog):
    """Found by an operator's walkthrough: a file without [metrics] turned every scrape into a
    401 and the log said "changed none"."""
    tenants_path.write_text(FILE.replace(f'[metrics]\napi_keys = ["{SCRAPER}"]\n', ""))
    with caplog.at_level(logging.INFO, logger="kvfence.server"):
        assert reload(srv).json()["metrics_keys_changed"] is True
    assert "reloaded without [metrics] keys: a Prometheus scraper with the old key now gets 401" in caplog.text
    assert "[operator]" not in caplog.text
    assert httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPER}"}, timeout=10).status_code \
        == 401


def test_a_file_that_does_not_load_changes_nothing(srv, tenants_path):
    tenants_path.write_text(FILE)
    assert reload(srv).status_code == 200   # one that works, then two that do not
    errors = metric(srv, "kvfence_tenants_reloads_total", result="error")
    tenants_path.write_text(FILE.replace("[tenants.bob]", "[tenants.bob]\nmax_prompt_tokens = -3"))
    r = reload(srv)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tenants_file", r.text
    assert "max_prompt_tokens must be a positive integer" in r.json()["error"]["message"]
    tenants_path.write_text("[tenants")
    assert reload(srv).json()["error"]["code"] == "invalid_tenants_file"
    assert metric(srv, "kvfence_tenants_reloads_total", result="error") == errors + 2
    shown = httpx.get(srv.url + "/v1/kvfence/console", headers={"Authorization": f"Bearer {OPERATOR}"},
                      timeout=30).json()["tenants"]             # the operator console says so
    assert shown["configured"] == 2 and shown["last_reload"]["result"] == "error"
    assert "not valid TOML" in shown["last_reload"]["error"]
    # what the last one that worked did stays in view (a failed reload hid it; found by a probe)
    good = shown["last_good_reload"]
    assert good["result"] == "ok" and good["at"] < shown["last_reload"]["at"] and "keys_revoked" in good
    for key in (ALICE, BOB):     # still served by the previous file
        assert client(srv, key).models.list().data


def test_only_the_operator_key_reloads(srv, make_server, server, single):
    for key in (None, ALICE, BOB, SCRAPER, "sk-not-a-key-000"):
        r = reload(srv, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_operator_key", (key, r.text)
    # a server whose file names no operator, or that has no file: the route is off, and says how
    # (one started without --tenants says that instead: it has no file to reload; a docs probe)
    for other, code in ((server, "operator_not_configured"), (single, "no_tenants_file")):
        r = reload(other, OPERATOR)
        assert r.status_code == 404 and r.json()["error"]["code"] == code, r.text


def test_a_rotated_operator_key_and_its_console_cookies_stop_working(srv, tenants_path):
    with httpx.Client(base_url=srv.url, timeout=30) as browser:
        r = browser.post("/console/login", data={"key": OPERATOR}, follow_redirects=False)
        assert r.status_code == 303
        assert browser.get("/v1/kvfence/console").status_code == 200     # the cookie works
        # but not to reload: a cookie rides along on a request another site makes the browser send
        assert browser.post("/v1/kvfence/tenants/reload").status_code == 401
        new_key = ROTATED_OPERATOR
        tenants_path.write_text(FILE.replace(OPERATOR, new_key))
        assert reload(srv).json()["operator_keys_changed"] is True
        assert browser.get("/v1/kvfence/console").status_code == 401     # the old key's cookie is dead
        assert reload(srv, OPERATOR).status_code == 401
        assert reload(srv, new_key).status_code == 200


# -- the parts, without a server -------------------------------------------------------------------
def test_the_change_names_tenants_and_counts_keys():
    def reg(text: str) -> TenantRegistry:
        import tomllib

        return TenantRegistry.from_dict(tomllib.loads(text))

    old = reg(FILE)
    new = reg(FILE.replace(f'"{ALICE2}"', '"sk-alice-0003"').replace("[tenants.bob]", "[tenants.bob]\n"
                                                                       "max_concurrent_requests = 2")
              + '\n[tenants.carol]\napi_keys = ["sk-carol-00001"]\n')
    change = registry_change(old, new)
    assert change["added"] == ["carol"] and change["removed"] == [] and change["changed"] == ["alice", "bob"]
    assert change["keys_revoked"] == 1 and change["keys_added"] == 2 and not change["operator_keys_changed"]
    alice2 = old.identify(f"Bearer {ALICE2}")[1]
    assert old.accepts(alice2, "alice") and not new.accepts(alice2, "alice")
    assert not new.accepts(new.identify(f"Bearer {BOB}")[1], "alice")     # a key names its own tenant only
    assert TenantRegistry.single().accepts(None, "default")


def test_only_leases_whose_key_is_refused_are_revoked():
    limiter, ended = TenantLimiter(), []
    a, b = limiter.hold(Tenant("a"), b"a"), limiter.hold(Tenant("b"), b"b")
    a.on_revoke = lambda: ended.append("a")
    b.on_revoke = lambda: ended.append("b")
    done = limiter.hold(Tenant("a"), b"a")
    done.release()
    assert limiter.revoke_unless(lambda lease: lease.key != b"a") == 1
    assert ended == ["a"] and a.revoked and not b.revoked and not done.revoked
    assert limiter.revoke_unless(lambda lease: lease.key != b"a") == 0     # once


class _NoEngine:
    """Unit-test stand-in for the backend: the reload asks it to retire removed tenants' pages."""
    snapshot: dict = {}
    facts: dict | None = None

    def __init__(self) -> None:
        self.forgotten: list = []

    async def forget_tenants(self, tenants: list[str], epoch: int = 0) -> int:
        self.forgotten.append(list(tenants))
        return 0


def test_a_retired_names_new_party_waits_until_every_node_has_retired_the_old_scope(tmp_path):
    """While the reload retires a name's scope on the nodes (behind the router, HTTP to each),
    the name's new party is told to retry: a request of it reaching a prefill node before that
    node's retirement would attach the old party's pages."""
    from kvfence.server.errors import APIError

    path = tmp_path / "tenants.toml"
    path.write_text(FILE)

    class SlowNodes(_NoEngine):
        async def forget_tenants(self, tenants: list[str], epoch: int = 0) -> int:
            with pytest.raises(APIError) as e:    # mid-retirement: the new bob is asked to retry
                state.refuse_if_paused(state.tenants.identify("Bearer sk-new-bob-0001")[0])
            assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
            state.refuse_if_paused(state.tenants.identify(f"Bearer {ALICE}")[0])   # others go on
            self.forgotten.append(list(tenants))
            return 0

    state = ServerState(SlowNodes(), TenantRegistry.from_file(path))  # type: ignore[arg-type]
    for name in ("alice", "bob"):   # a minute's usage: the new bob must not inherit (or read) the old one's
        state.limiter.admit(Tenant(name, Limits(tokens_per_minute=10_000)), 100, 20).release(20)
    path.write_text(FILE.replace(BOB, "sk-new-bob-0001"))
    change = asyncio.run(state.reload_tenants("test"))
    assert change["retired"] == ["bob"] and state.engine.forgotten == [["bob"]]
    assert state.limiter.tokens_in_window("bob") == 0 and state.limiter.tokens_in_window("alice") == 120
    state.refuse_if_paused(state.tenants.identify("Bearer sk-new-bob-0001")[0])    # and then it is served


def test_a_prompt_cap_beyond_the_context_is_pointed_out_at_start_and_at_reload(tmp_path, caplog):
    """The tenants file cannot know the model's context: a max_prompt_tokens at or beyond it
    was taken without a word (the cap never applies; such prompts get context_length_exceeded).
    Said once the context is known: when the server state is made (after the model or the
    nodes) and at each reload. A cap below the context is not named."""
    path = tmp_path / "tenants.toml"
    path.write_text(FILE.replace(f'api_keys = ["{BOB}"]', f'api_keys = ["{BOB}"]\nmax_prompt_tokens = 4096'))

    class Ready(_NoEngine):
        facts = {"usable_context": 2048}

    with caplog.at_level(logging.WARNING):
        state = ServerState(Ready(), TenantRegistry.from_file(path))  # type: ignore[arg-type]
    said = [r.message for r in caplog.records if "max_prompt_tokens" in r.message]
    assert len(said) == 1 and "'bob'" in said[0] and "2048" in said[0] and "'alice'" not in said[0], caplog.text
    caplog.clear()
    path.write_text(FILE.replace(f'api_keys = ["{ALICE}", "{ALICE2}"]',
                                 f'api_keys = ["{ALICE}", "{ALICE2}"]\nmax_prompt_tokens = 2048'))
    with caplog.at_level(logging.WARNING):
        asyncio.run(state.reload_tenants("test"))
    said = [r.message for r in caplog.records if "max_prompt_tokens" in r.message]
    assert len(said) == 1 and "'alice'" in said[0] and "'bob'" not in said[0], caplog.text
    caplog.clear()
    path.write_text(FILE.replace(f'api_keys = ["{ALICE}", "{ALICE2}"]',
                                 f'api_keys = ["{ALICE}", "{ALICE2}"]\nmax_prompt_tokens = 2047'))
    with caplog.at_level(logging.WARNING):
        asyncio.run(state.reload_tenants("test"))
    assert "max_prompt_tokens" not in caplog.text


def test_sighup_reloads_the_file_and_is_harmless_without_one(tmp_path, caplog):
    """The handler the server's lifespan installs (in the main thread, as `kvfence serve` runs)."""
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    with_file = ServerState(_NoEngine(), TenantRegistry.from_file(path))  # type: ignore[arg-type]
    without = ServerState(_NoEngine(), TenantRegistry.single())  # type: ignore[arg-type]
    fallback = signal.signal(signal.SIGHUP, lambda *_: None)   # had no handler been set, do not die

    async def main() -> None:
        for state in (with_file, without):
            assert _reload_on_sighup(state)
            try:
                path.write_text(WITHOUT_BOB)
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if state is with_file and "bob" not in state.tenants.tenants:
                        break
            finally:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    try:
        with caplog.at_level(logging.INFO, logger="kvfence.server"):
            asyncio.run(main())
    finally:
        signal.signal(signal.SIGHUP, fallback)
    assert sorted(with_file.tenants.tenants) == ["alice"] and with_file.engine.forgotten == [["bob"]]
    assert "SIGHUP ignored: no tenants file to reload" in caplog.text
    assert "reloaded (SIGHUP)" in caplog.text


def test_kvfence_serve_reloads_its_tenants_file_on_sighup(tmp_path):
    """The real process: a key added and another revoked by editing the file and sending SIGHUP;
    a broken file then changes nothing."""
    from kvfence.procs import free_ports

    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port), "--dtype", "float32",
                          "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--threads", "1",
                          "--tenants", str(path)],
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=log, stderr=subprocess.STDOUT)

    def status(key: str) -> int:
        try:
            return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def logged(text: bytes) -> bool:
        return text in (tmp_path / "serve.log").read_bytes()

    try:
        # while the model loads: the signal is kept, and the reload runs once it serves
        assert wait_for(lambda: logged(b"loading the model"), timeout=60), (tmp_path / "serve.log").read_text()
        new_bob = "sk-bob-rotated-01"
        path.write_text(FILE.replace(BOB, new_bob))
        p.send_signal(signal.SIGHUP)
        assert wait_for(lambda: status(new_bob) == 200, timeout=180), (tmp_path / "serve.log").read_text()[-3000:]
        assert status(BOB) == 401
        path.write_text("[tenants")      # while serving: a broken file changes nothing
        p.send_signal(signal.SIGHUP)
        assert wait_for(lambda: logged(b"tenants file not reloaded (SIGHUP)"), timeout=30)
        assert p.poll() is None and status(new_bob) == 200 and status(ALICE) == 200
        path.write_text(WITHOUT_BOB)     # and a good one is in force
        p.send_signal(signal.SIGHUP)
        assert wait_for(lambda: status(new_bob) == 401, timeout=30) and status(ALICE) == 200
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

