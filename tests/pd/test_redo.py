"""A node that fails a request's handoff, after prefill held the KV and before anything
reached the client, costs the client nothing where the fleet has another node of its role:
the router does the whole request again without it (RouterBackend._run, may_redo). Real
processes (two prefill and two decode nodes, one router) and the real transfer engine:

- a decode node killed after it pulled a request's rows, before it verified them: the
  request is answered by the other decode node, the redo is counted, and the prefill rows the
  dead node may still have been reading are fenced, then freed (I6), not handed out at once;
- a prefill node killed while it holds a request's KV, before decode read it: decode's read
  fails (kv_transfer_failed: either end may be at fault), the redo skips the prefill node
  (the fleet has another; with one decode node left, decode is not skipped), and the request
  is answered from the other prefill node.

With one node per role the client gets the 503 as before (tests/pd/test_cluster.py).
Then the router's operator console, in a real browser, shows the redos and the dead nodes.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from browser import Browser, chromium_or_skip
from pd_cluster import ROOT, SCRAPE, SCRAPE_KEY, MultiCluster
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

NODES = {"prefill": "prefill", "prefill-2": "prefill", "decode": "decode", "decode-2": "decode"}
# each over two pages of 16 tokens, and different from its first words on: the prefix cache
# holds none of them before its first request (and a redo's prefill finds the first attempt's)
_TAIL = (" (asked in a quiz for beginners, who read the answer aloud to the class, so keep it short, plain and "
         "friendly)")
PROMPTS = [p + _TAIL for p in (
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n): a question",
    "The three primary colors are", "Once upon a time, in a small village,", "Water boils at")]


TENANT_KEY, OPERATOR_KEY = "sk-redo-tenant-0001", "sk-redo-operator-01"
TENANTS = f"""
[tenants.quiz]
api_keys = ["{TENANT_KEY}"]

[metrics]
api_keys = ["{SCRAPE_KEY}"]

[operator]
api_keys = ["{OPERATOR_KEY}"]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pd-redo")
    (workdir / "tenants.toml").write_text(TENANTS)   # the operator key opens the router's console
    c = MultiCluster(workdir, NODES, router_args=["--tenants", str(workdir / "tenants.toml")]).start_all(300)
    yield c
    c.stop()


@pytest.fixture
def client(fleet):
    fleet.clear_faults()
    # no client-side retry: what the client sees is what the router made of the failure
    yield openai.OpenAI(base_url=fleet.url("router") + "/v1", api_key=TENANT_KEY, max_retries=0, timeout=90)
    fleet.clear_faults()


def _retries(fleet, stage: str) -> int:
    text = httpx.get(fleet.url("router") + "/metrics", headers=SCRAPE, timeout=10).text
    return int(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "kvfence_pd_request_retries_total" and s.labels.get("stage") == stage))


def _counted(fleet, stage: str, at_least: int) -> int:
    """The router's count once it reached `at_least` (its metrics are the snapshot its monitor
    takes every second), or the last one seen after 10 s."""
    end = time.monotonic() + 10
    while (n := _retries(fleet, stage)) < at_least and time.monotonic() < end:
        time.sleep(0.2)
    return n


def _settled(fleet, names: list[str], timeout: float = 60) -> None:
    """The surviving nodes hold nothing: pool pages, running requests, transfer rows."""
    end, last = time.monotonic() + timeout, {}
    while time.monotonic() < end:
        last = {n: fleet.info(n)["snapshot"] for n in names}
        if all(s["pages_owned"] == 0 and s["running"] == 0 and s["pd"]["buffer_free"] == s["pd"]["buffer_rows"]
               for s in last.values()):
            assert not any(s["violations"] for s in last.values()), last
            return
        time.sleep(0.3)
    raise AssertionError(f"the surviving nodes did not settle: {last}")


def test_a_decode_node_dying_before_it_verified_the_kv_is_redone_on_the_other(fleet, client):
    """kill_node_at:decode_after_pull on one decode node: it dies at the first request it pulls.
    It is the one the router picks first (idle, equal pools: the lower URL), and requests go two
    at a time, so each decode node gets one (the least loaded is picked). Every request is
    answered, with the text the fleet gives the same prompt without any fault (greedy); the one
    whose decode died was done again, and the router counts it."""
    armed = min(("decode", "decode-2"), key=fleet.url)
    survivor = "decode-2" if armed == "decode" else "decode"
    fleet.set_faults(armed, "kill_node_at:decode_after_pull")
    model = client.models.list().data[0].id
    redone0 = _retries(fleet, "handoff")
    outcomes: list[str] = []
    texts: dict[str, str] = {}
    cached: dict[str, int] = {}

    def ask(prompt: str) -> None:
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
            outcomes.append(r.choices[0].finish_reason)
            texts[prompt] = r.choices[0].text
            cached[prompt] = r.usage.prompt_tokens_details.cached_tokens
        except openai.APIStatusError as e:
            outcomes.append(f"{e.status_code}:{e.code}:{e.message}")

    for pair in (PROMPTS[0:2], PROMPTS[2:4], PROMPTS[4:6]):
        threads = [threading.Thread(target=ask, args=(p,)) for p in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if fleet.procs[armed].poll() is not None:
            break
    assert fleet.procs[armed].poll() is not None, ("the armed decode node never got a request", outcomes)
    assert outcomes and all(o in ("length", "stop") for o in outcomes), outcomes   # no 503 reached a client
    assert _counted(fleet, "handoff", redone0 + 1) >= redone0 + 1
    # no prompt was cached before its request: a redo's prefill found the first attempt's pages,
    # which the request computed itself (its usage said them cached)
    assert set(cached.values()) == {0}, cached
    for prompt, text in texts.items():   # the redo's answer is the prompt's own, not a broken attempt's
        again = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert again.choices[0].text == text, (prompt, text, again.choices[0].text)
    # the dead node may still have been reading the first attempt's rows when it died: prefill
    # fenced them, then freed them once no read could still run; the survivors hold nothing
    _settled(fleet, ["prefill", "prefill-2", survivor])


def test_a_prefill_node_dying_while_it_holds_the_kv_is_redone_on_the_other(fleet, client):
    """The router waits 2 s between prefill holding the KV and the handoff (delay_handoff);
    the prefill node that holds it is killed in that wait. Decode cannot read the rows and says
    so; the router does the request again on the other prefill node, and the client gets its
    answer."""
    alive_prefill = [n for n in ("prefill", "prefill-2") if fleet.procs[n].poll() is None]
    alive_decode = [n for n in ("decode", "decode-2") if fleet.procs[n].poll() is None]
    assert len(alive_prefill) == 2 and alive_decode, "the fleet this test needs"
    fleet.set_faults("router", "delay_handoff:2")
    model = client.models.list().data[0].id
    redone0 = _retries(fleet, "handoff")
    before = {n: fleet.info(n)["snapshot"]["pd"]["buffer_free"] for n in alive_prefill}
    result: dict = {}

    def ask() -> None:
        try:
            r = client.completions.create(model=model, prompt=PROMPTS[0] + " and the capital of Spain is",
                                          max_tokens=4, temperature=0)
            result["finish"], result["text"] = r.choices[0].finish_reason, r.choices[0].text
        except openai.APIStatusError as e:
            result["error"] = f"{e.status_code}:{e.code}:{e.message}"

    t = threading.Thread(target=ask)
    t.start()
    holder, end = None, time.monotonic() + 60
    while holder is None:
        assert time.monotonic() < end and t.is_alive(), ("no prefill node held the request's KV", result)
        holder = next((n for n in alive_prefill if fleet.info(n)["snapshot"]["pd"]["buffer_free"] < before[n]), None)
        time.sleep(0.05)
    fleet.procs[holder].kill()
    t.join(120)
    assert result.get("finish") in ("length", "stop"), result
    assert _counted(fleet, "handoff", redone0 + 1) >= redone0 + 1
    fleet.clear_faults()
    again = client.completions.create(model=model, prompt=PROMPTS[0] + " and the capital of Spain is",
                                      max_tokens=4, temperature=0)
    assert again.choices[0].text == result["text"], (result, again.choices[0].text)
    other = next(n for n in alive_prefill if n != holder)
    _settled(fleet, [other, *alive_decode])


def test_the_router_console_shows_the_redos_and_the_nodes_that_died(fleet, tmp_path):
    """After the two tests above (each redid a request and killed a node), the router's console
    in a real browser: its retries table says the redos /metrics counts, and the nodes table
    shows the router and all four nodes, the dead ones not ready."""
    exe = chromium_or_skip()
    redone = _retries(fleet, "handoff")
    if redone == 0:
        pytest.skip("the console shows this module's redos: run the tests above first")
    dead = {fleet.url(n) for n in NODES if fleet.procs[n].poll() is not None}
    assert dead, "the tests above leave a dead node"
    dom = asyncio.run(asyncio.wait_for(_look(fleet.url("router"), exe, tmp_path), 90))
    # no script error, nothing the page's Content Security Policy blocked (the sign-in page's 401 is logged)
    assert not [m for m in dom["messages"] if "Content Security Policy" in m or m.startswith("exception")], dom
    assert dom["retries"].get("handoff") == redone, dom["retries"]
    assert [n["name"] for n in dom["nodes"]][0] == "router"
    states = {n["name"]: n["state"] for n in dom["nodes"][1:]}
    assert set(states) == {fleet.url(n) for n in NODES}, states
    assert all((states[u] != "ready") == (u in dead) for u in states), (states, dead)
    # a dead node's pool is what it last reported, and the page says so
    assert set(dom["stale_pools"]) == dead, dom


async def _look(url: str, exe: str, tmp_path: Path) -> dict:
    async with Browser(exe, tmp_path / "chromium") as b:
        await b.navigate(url + "/console")
        await b.eval(f"document.getElementById('key').value = {json.dumps(OPERATOR_KEY)};"
                     "document.querySelector('form').submit(); true")
        await b.wait_for("document.body && Number(document.body.dataset.renders || 0) >= 1", 60)
        dom = await b.eval("""(() => {
          const all = (sel) => [...document.querySelectorAll(sel)];
          return {
            nodes: all('#nodes tr[data-node]').map((tr) => ({name: tr.dataset.node, state: tr.dataset.state})),
            stale_pools: all('.pool[data-stale="1"]').map((p) => p.dataset.node),
            retries: Object.fromEntries(all('#requests .counters[data-group="pd_retries"] tr[data-key]')
              .map((tr) => [tr.dataset.key, Number(tr.dataset.total)])),
          };
        })()""")
        dom["messages"] = b.messages()
        shot = await b.screenshot(tmp_path / "console-router.png")
        if os.environ.get("KVFENCE_UPDATE_DOCS"):
            shutil.copy(shot, ROOT / "docs" / "console-router.png")
        return dom
