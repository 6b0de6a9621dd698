"""The operator console on a real server: who gets in (only the operator's key, never a
tenant's), its security headers, and the page itself in headless Chromium with two tenants'
traffic: the nodes, a pool map whose counts equal /metrics while requests hold pages, a real
incident (a refused cross-tenant read) in the log, nothing a tenant sent, and a screenshot."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from browser import Browser, chromium_or_skip
from server_harness import KEYS, MODEL, TENANTS_TOML, wait_for

from kvfence import incidents
from kvfence.server.tenants import TenantRegistry

OPERATOR_KEY = "op-console-key-0001"
OPERATOR_TOML = TENANTS_TOML + f'\n[operator]\napi_keys = ["{OPERATOR_KEY}"]\n'
ROOT = Path(__file__).resolve().parents[2]
ROUTES = ("/console", "/console/console.js", "/console/console.css", "/v1/kvfence/console", "/v1/kvfence/incidents")


@pytest.fixture(scope="module")
def console_server(make_server):
    return make_server(tenants=OPERATOR_TOML)


def _get(srv, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(srv.url + path, headers=headers, timeout=30, follow_redirects=False, **kw)


def test_the_bare_address_says_what_answers_there(server, console_server):
    """Found by an operator walkthrough: GET / was a JSON 404. It names the OpenAI base URL
    and the console (null where it is off); a browser goes straight to the console where it
    is on. No key needed, and nothing about tenants or the model in it."""
    r = _get(server, "/")
    assert r.status_code == 200 and r.json() == {"service": "kvfence", "openai_base_url": "/v1",
                                                 "health": "/health", "console": None}
    html = {"accept": "text/html,application/xhtml+xml"}
    assert httpx.get(server.url + "/", headers=html, timeout=30).status_code == 200
    assert _get(console_server, "/").json()["console"] == "/console"
    r = httpx.get(console_server.url + "/", headers=html, timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/console"


def test_a_trailing_slash_is_never_redirected_to_the_host_a_client_named(server, console_server):
    """Starlette's slash redirects built their Location from the Host header (a 307 to
    http://evil.example/console for a request that named that host). /console/ is what people
    type: it goes to /console by a relative Location; another route's slash is a 404 that
    names the route."""
    evil = {"host": "evil.example"}

    def get(srv, path: str) -> httpx.Response:
        return httpx.get(srv.url + path, headers=evil | {"authorization": f"Bearer {KEYS['alice']}"}, timeout=30,
                         follow_redirects=False)

    r = get(console_server, "/console/")
    assert r.status_code == 308 and r.headers["location"] == "/console"
    assert r.headers["cache-control"] == "no-store"
    for path in ("/health/", "/health/live/", "/metrics/"):
        r = get(server, path)
        assert r.status_code == 404 and "location" not in r.headers, path
        assert r.json()["error"]["message"].endswith(f"Did you mean {path[:-1]}?"), r.text
    assert "Did you mean" not in get(server, "/nothing/").text


def test_without_an_operator_key_the_console_is_off_and_says_how_to_turn_it_on(server):
    for path in ROUTES:
        r = _get(server, path, KEYS["alice"])
        assert r.status_code == 404, path
        assert "[operator]" in r.text and "alice" not in r.text
    assert "&lt;key&gt;" in _get(server, "/console").text       # the message is escaped in its HTML


def test_only_the_operators_key_gets_in_never_a_tenants(console_server):
    srv = console_server
    for key in (None, KEYS["alice"], KEYS["bob"], "op-console-key-0002", OPERATOR_KEY.upper()):
        for path in ROUTES:
            r = _get(srv, path, key)
            assert r.status_code == 401, (key, path, r.status_code)
            assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
            # an unauthenticated probe learns nothing: no model, tenant, version or node
            for leak in ("alice", "bob", MODEL, "SmolLM", "0.1.0", "local"):
                assert leak not in r.text, (path, leak)
    assert 'name="key"' in _get(srv, "/console").text            # the sign-in form, and only that
    r = _get(srv, "/console", OPERATOR_KEY)
    assert r.status_code == 200 and '<script src="/console/console.js"' in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert _get(srv, "/console/console.js", OPERATOR_KEY).headers["content-type"].startswith("application/javascript")
    view = _get(srv, "/v1/kvfence/console", OPERATOR_KEY).json()
    assert view["nodes"][0]["name"] == "local" and view["nodes"][0]["checks"]
    text = json.dumps(view)
    for key in KEYS.values():
        assert key not in text
    assert OPERATOR_KEY not in text


def test_a_browser_signs_in_once_with_a_form_and_gets_an_httponly_strict_cookie(console_server):
    srv = console_server
    form = {"content-type": "application/x-www-form-urlencoded"}
    for key in (KEYS["alice"], "nope-nope-nope"):               # a tenant's key never signs in
        r = httpx.post(srv.url + "/console/login", content=f"key={key}", headers=form, timeout=30)
        assert r.status_code == 401 and "set-cookie" not in r.headers
    r = httpx.post(srv.url + "/console/login", content=f"key={OPERATOR_KEY}", timeout=30,
                   headers={**form, "origin": "https://evil.example"})
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.post(srv.url + "/console/login", content=f"key={OPERATOR_KEY}", headers=form, timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/console"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and OPERATOR_KEY not in cookie
    value = r.cookies["kvfence_console"]
    assert _get(srv, "/v1/kvfence/console", cookies={"kvfence_console": value}).status_code == 200
    forged = value[:-4] + ("0000" if not value.endswith("0000") else "1111")
    assert _get(srv, "/v1/kvfence/console", cookies={"kvfence_console": forged}).status_code == 401
    # found in review: '²' passed isdigit() and int() raised (a 500); a pasted key with a space
    # around it signed in (is_operator strips it) but its cookie was signed over the spaces
    r = httpx.get(srv.url + "/v1/kvfence/console", headers={"cookie": "kvfence_console=\u00b2.x".encode("latin-1")},
                  timeout=30)
    assert r.status_code == 401
    r = httpx.post(srv.url + "/console/login", content=f"key=+{OPERATOR_KEY}+", headers=form, timeout=30)
    assert r.status_code == 303
    assert _get(srv, "/v1/kvfence/console", cookies={"kvfence_console": r.cookies["kvfence_console"]}).status_code \
        == 200
    # found in review: more fields than the parser takes raised ValueError (a 500)
    r = httpx.post(srv.url + "/console/login", content="&".join(f"f{i}=x" for i in range(9)) + f"&key={OPERATOR_KEY}",
                   headers=form, timeout=30)
    assert r.status_code == 400 and "set-cookie" not in r.headers and "fields" in r.json()["error"]["message"]


def test_signing_out_ends_the_session_and_only_this_origin_may_ask(console_server):
    """Found in review: sign-out had no origin check, and it only cleared the browser's cookie;
    a copy of the cookie kept working for the rest of its 12 hours."""
    srv = console_server
    form = {"content-type": "application/x-www-form-urlencoded"}
    value = httpx.post(srv.url + "/console/login", content=f"key={OPERATOR_KEY}", headers=form,
                       timeout=30).cookies["kvfence_console"]
    jar = {"kvfence_console": value}
    r = httpx.post(srv.url + "/console/logout", cookies=jar, headers={"origin": "https://evil.example"}, timeout=30)
    assert r.status_code == 403 and _get(srv, "/v1/kvfence/console", cookies=jar).status_code == 200
    r = httpx.post(srv.url + "/console/logout", timeout=30)   # no session: clears the cookie, ends nothing
    assert r.status_code == 303 and _get(srv, "/v1/kvfence/console", cookies=jar).status_code == 200
    r = httpx.post(srv.url + "/console/logout", cookies=jar, timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/console"
    assert _get(srv, "/v1/kvfence/console", cookies=jar).status_code == 401
    assert _get(srv, "/v1/kvfence/console", OPERATOR_KEY).status_code == 200   # the key itself still works


def test_wrong_keys_on_metrics_and_on_the_console_count_together(make_server):
    """Found in review: the console and /metrics each had a table, so one address got each
    route's limit of guesses of the operator's key."""
    from kvfence.server.auth_throttle import LIMIT

    srv = make_server(tenants=OPERATOR_TOML)
    for i in range(LIMIT):
        assert _get(srv, "/metrics", f"sk-guess-{i:05d}").status_code == 401
    r = _get(srv, "/v1/kvfence/console", OPERATOR_KEY)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1


def _hold_engine(srv) -> tuple[threading.Event, threading.Event]:
    """Block the engine thread in a call of its own: no step runs, so the snapshot that
    /metrics and the console both read stays exactly as it is until `release` is set."""
    entered, release = threading.Event(), threading.Event()

    def hold(engine) -> None:
        entered.set()
        release.wait(60)

    threading.Thread(target=lambda: asyncio.run(srv.engine.call(hold)), daemon=True).start()
    assert entered.wait(30), "the engine thread did not take the call"
    return entered, release


def _kv_pages(srv) -> dict[str, int]:
    return {s: int(srv.metric("kvfence_kv_pages", state=s)) for s in ("used", "free", "shared", "quarantined")}


def test_the_console_in_a_real_browser(make_server, tmp_path):
    exe = chromium_or_skip()
    log_path = tmp_path / "incidents-single-0.jsonl"
    incidents.open_log(log_path, "single", boot_id="console-test")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(OPERATOR_TOML)
    try:
        _browser_run(make_server(registry=TenantRegistry.from_file(tenants)), exe, tmp_path, log_path)
    finally:
        incidents.close_log()


def _browser_run(srv, exe: str, tmp_path: Path, log_path: Path) -> None:
    canary = f"CANARY-{uuid.uuid4().hex[:12]}"
    kw = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
    # traffic of two tenants (and a public scope), leaving prefix-cache pages behind
    for who in ("alice", "bob", "pub1"):
        srv.client(who).completions.create(prompt=f"{who} says {canary}: " + "a b c d e f g h " * 6, max_tokens=4,
                                           **kw)
    # a real incident: alice's request is made to read one of bob's pages; the ledger refuses
    done: dict = {}
    bob_prompt = f"Bob's note {canary}. Count:" + " one two three four five" * 6
    t = threading.Thread(target=lambda: done.update(bob=srv.client("bob").completions.create(
        prompt=bob_prompt, max_tokens=48, **kw)))
    srv.spy.step_delay = 0.05   # bob still runs when alice comes, however fast the machine (~3 s)
    t.start()
    try:
        assert wait_for(lambda: srv.engine.snapshot.get("running", 0) >= 1, 30)
        srv.spy.foreign_tenants.add("alice")
        with pytest.raises(openai.InternalServerError):
            srv.client("alice").completions.create(prompt=f"Alice's note {canary}, a story.", max_tokens=48, **kw)
    finally:
        srv.spy.step_delay = 0.0
    t.join(60)
    refusal = next(r for r in incidents.read(log_path) if r["kind"] == "ledger_refusal")
    # a record whose detail is markup: the page must show it as text
    incidents.record("node_refused", detail='<img id="xss" src="x" onerror="document.title=\'pwned\'"> not markup')

    # two long streams hold pages; then the engine is held still, so the counts cannot move
    streams = [srv.client(who).completions.create(prompt=f"{who} streams {canary} " + "x y z " * 20,
                                                  max_tokens=600, stream=True, **kw) for who in ("alice", "bob")]
    for s in streams:
        next(iter(s))           # each has its first token: both are running and hold pages
    r = httpx.post(srv.url + "/v1/kvfence/tenants/reload", headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["changed"] == [], r.text    # the same file: the page shows it
    source = Path(srv.state.tenants.source)
    good_file = source.read_text()
    source.write_text("[tenants")    # then one that fails: the page shows both
    assert httpx.post(srv.url + "/v1/kvfence/tenants/reload", headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                      timeout=30).status_code == 400
    source.write_text(good_file)
    _, release = _hold_engine(srv)
    try:
        snap = srv.engine.snapshot
        owned = snap["pages_by_owner"]["owned"]
        assert owned.get("alice", 0) > 0 and owned.get("bob", 0) > 0, snap
        pages = _kv_pages(srv)
        dom = asyncio.run(asyncio.wait_for(_look(srv, exe, tmp_path), 60))
        assert _kv_pages(srv) == pages                          # still the same moment
        latency = _get(srv, "/v1/kvfence/console", OPERATOR_KEY).json()["requests"]["latency"]
    finally:
        release.set()
        for s in streams:
            s.response.close()
    srv.wait_idle()

    # nodes: the one local node with its start-up checks, all shown
    assert [n["name"] for n in dom["nodes"]] == ["local"] and dom["nodes"][0]["state"] == "ready"
    assert dom["nodes"][0]["checks"] == len(srv.engine.startup_checks) > 0
    # the pool map: every state's count equals /metrics at that moment, per tenant the engine's own
    (pool,) = dom["pools"]
    legend = pool["legend"]
    assert legend["free"] == pages["free"]
    assert sum(v for k, v in legend.items() if k.startswith("owned:")) == pages["used"]
    assert {k[6:]: v for k, v in legend.items() if k.startswith("owned:")} == owned
    assert sum(v for k, v in legend.items() if k.startswith("shared:")) == pages["shared"]
    assert legend["quarantined"] + legend["fenced"] == pages["quarantined"]
    assert legend["shared:public:shared-docs"] > 0 and legend["shared:bob"] > 0
    assert pool["cells"] == sum(legend.values()) == snap["pages_total"]
    assert len(set(pool["owner_colours"])) == len(pool["owner_colours"]) == 2   # one colour per tenant
    # the incident log, newest first: the escaped test record, then the real refusal
    assert [r["kind"] for r in dom["incidents"][:2]] == ["node_refused", "ledger_refusal"]
    assert dom["incidents"][1]["request"] == refusal["request_id"]
    assert dom["xss_element"] is None and dom["title"] != "pwned" and '<img id="xss"' in dom["incident_text"]
    # each tenant's first-token and wait-to-run quantiles, as the JSON has them (the held streams
    # are not answered yet: alice's failed request and bob's long one are the ones counted)
    assert set(dom["latency"]) == set(latency) >= {"alice", "bob", "pub1"}, (dom["latency"], latency)
    for tenant, row in latency.items():
        assert dom["latency"][tenant] == {"ttft_p95": str(row["ttft_p95"]), "queue_p95": str(row["queue_p95"])}
    assert latency["bob"]["ttft_count"] == 2 and 0 < latency["bob"]["queue_p95"] <= latency["bob"]["ttft_p95"]
    # rates appear from the second refresh on; the isolation statement is rendered
    assert dom["outcomes"]["length"] >= 3 and dom["rates_shown"]
    assert "kv memory isolation" in dom["isolation_text"]
    assert dom["misaligned_headers"] == []
    # the tenants file in force, and its last reload
    assert "Tenants: 7, from " in dom["tenants_text"] and "tenants.toml" in dom["tenants_text"]
    assert "Last reload" in dom["tenants_text"] and "(POST /v1/kvfence/tenants/reload)" in dom["tenants_text"]
    assert "0 key(s) revoked, 0 request(s) in flight ended" in dom["tenants_text"]
    assert "FAILED, the previous file stays in force" in dom["tenants_text"]
    assert "The last that worked:" in dom["tenants_text"]
    # nothing a tenant sent or holds: no prompt text, no key; the cookie is out of the page's reach
    assert canary not in dom["html"] and all(k not in dom["html"] for k in KEYS.values())
    assert OPERATOR_KEY not in dom["html"] and dom["document_cookie"] == ""
    (cookie,) = [c for c in dom["cookies"] if c["name"] == "kvfence_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and OPERATOR_KEY not in cookie["value"]
    blocked = [m for m in dom["messages"] if "Content Security Policy" in m or m.startswith("exception")]
    assert not blocked, blocked
    # once idle the console says so too
    view = _get(srv, "/v1/kvfence/console", OPERATOR_KEY).json()
    assert view["pools"][0]["owned"] == {} and view["pools"][0]["owned_total"] == 0 == _kv_pages(srv)["used"]


async def _look(srv, exe: str, tmp_path: Path) -> dict:
    async with Browser(exe, tmp_path / "chromium") as b:
        await b.navigate(srv.url + "/console")
        assert await b.eval("!!document.querySelector('form[action=\"/console/login\"]')")   # the 401 page
        await b.eval(f"document.getElementById('key').value = {json.dumps(OPERATOR_KEY)};"
                     "document.querySelector('form').submit(); true")
        await b.wait_for("document.body && Number(document.body.dataset.renders || 0) >= 2", 30)
        dom = await b.eval(_READ_DOM)
        dom["cookies"] = (await b.send("Network.getCookies", {"urls": [srv.url]}))["cookies"]
        dom["messages"] = b.messages()
        shot = await b.screenshot(tmp_path / "console.png")
        if os.environ.get("KVFENCE_UPDATE_DOCS"):
            shutil.copy(shot, ROOT / "docs" / "console.png")
        return dom


_READ_DOM = """(() => {
  const all = (sel, root) => [...(root || document).querySelectorAll(sel)];
  const pools = all('.pool[data-node]').map((p) => {
    const legend = {};
    for (const li of all('ul.legend li', p)) legend[li.dataset.key] = Number(li.dataset.count);
    return {node: p.dataset.node, legend, cells: all('.cell', p).length,
            owner_colours: all('ul.legend li', p).filter((li) => li.dataset.key.startsWith('owned:'))
              .map((li) => li.querySelector('.swatch').style.backgroundColor)};
  });
  const outcomes = {};
  for (const tr of all('#requests .counters[data-group="by_outcome"] tr[data-key]'))
    outcomes[tr.dataset.key] = Number(tr.dataset.total);
  return {
    nodes: all('#nodes tr[data-node]').map((tr) => ({name: tr.dataset.node, state: tr.dataset.state,
                                                     checks: all('li[data-check]', tr).length})),
    pools, outcomes,
    latency: Object.fromEntries(all('#requests .counters[data-group="latency"] tr[data-tenant]').map((tr) =>
      [tr.dataset.tenant, {ttft_p95: tr.dataset.ttftP95, queue_p95: tr.dataset.queueP95}])),
    rates_shown: all('#requests td.num').some((td) => /^[0-9]+[.][0-9]{2}$/.test(td.textContent)),
    incidents: all('#incidents tr[data-kind]').map((tr) => ({kind: tr.dataset.kind, request: tr.dataset.request})),
    incident_text: document.getElementById('incidents').textContent,
    xss_element: document.getElementById('xss'), title: document.title,
    isolation_text: document.getElementById('isolation').textContent,
    tenants_text: document.getElementById('tenants').textContent,
    html: document.documentElement.outerHTML, document_cookie: document.cookie,
    // headers aligned unlike their column's cells (numbers right, their header over them)
    misaligned_headers: all('table').flatMap((t) => {
      const first = t.querySelector('tbody tr');
      return first ? all('thead th', t).filter((th, i) => first.children[i] &&
        getComputedStyle(th).textAlign !== getComputedStyle(first.children[i]).textAlign)
        .map((th) => th.textContent) : [];
    }),
  };
})()"""


def test_guessing_the_operator_key_is_bounded_per_address(make_server):
    """30 wrong keys from one address (bearer headers and sign-in forms alike) and that
    address gets 429 with Retry-After, even with the right key; another address and the
    tenants' own routes are unaffected. Without the throttle the right key gets in."""
    srv = make_server(tenants=OPERATOR_TOML)
    for i in range(30):
        if i % 2:
            r = _get(srv, "/v1/kvfence/console", f"guess-{i:04d}-abcdef")
        else:
            r = httpx.post(srv.url + "/console/login", data={"key": f"guess-{i:04d}-abcdef"}, timeout=30)
        assert r.status_code == 401, (i, r.status_code)
    for path in ("/v1/kvfence/console", "/console"):
        r = _get(srv, path, OPERATOR_KEY)
        assert r.status_code == 429, (path, r.status_code)
        assert 1 <= int(r.headers["retry-after"]) <= 60
    r = httpx.post(srv.url + "/console/login", data={"key": OPERATOR_KEY}, timeout=30, follow_redirects=False)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_failed_sign_ins"
    # the same server from another loopback address, and a tenant's inference from the first
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as other:
        assert other.get(srv.url + "/v1/kvfence/console",
                         headers={"authorization": f"Bearer {OPERATOR_KEY}"}).status_code == 200
    r = httpx.post(srv.url + "/v1/completions", headers={"authorization": f"Bearer {KEYS['alice']}"},
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
