"""The router's fleet logic without processes: the per-node capacity check (I8) and states,
prefix-affinity routing with its load bound, decode by load, and the merged snapshot."""
from __future__ import annotations

from collections import Counter

import pytest

from kvfence.pd.capacity import plan_fleet
from kvfence.pd.fleet import Fleet
from kvfence.pd.messages import NodeInfo
from kvfence.pd.router import _merge_snapshots


def info(role="prefill", usable=1024, boot="b1", fingerprint="fp", free=80, draining=False, **kw) -> NodeInfo:
    d = dict(model_name="m", model_path="/m", default_served_name="m", fingerprint=fingerprint, dtype="float32",
             weights="bf16",
             device="cpu", page_size=16, pool_pages=90, pool_tokens=1440, pool_bytes=1, model_max_context=8192,
             configured_max_model_len=1024, usable_context=usable, context_clamped=False, context_note="",
             scrub="zero", read_checks=True, max_num_seqs=8, max_num_batched_tokens=512, vocab_size=49152,
             prefix_cache=True,
             pd=dict(role=role, boot_id=boot, transfer_session="127.0.0.1:1", buffer_base=0, kv_layout="L",
                     slot_bytes=1, buffer_rows=90, lease_s=4.0, max_pull_s=3.0, clock_skew_s=0.5),
             snapshot={"running": 1, "waiting": 2, "pages_free": free, "pages_total": 90, "usable_context": usable,
                       "draining": draining, "violations": {}, "tokens_computed": 100})
    d.update(kw)
    return NodeInfo.from_json(d)


URLS = {"prefill": ["http://p1", "http://p2", "http://p3"], "decode": ["http://d1", "http://d2"]}


def fleet(usable=1024) -> Fleet:
    f = Fleet(URLS, usable, info())
    for n in f.nodes:
        f.observe(n, info(n.role, boot=n.url))
    return f


def test_a_node_below_the_advertised_context_or_on_another_model_is_refused():
    f = fleet()
    p1, p2 = f.nodes[0], f.nodes[1]
    f.observe(p1, info(usable=512, boot="new"))
    assert p1.state == "refused" and "exceeds the prefill node's usable capacity of 512 tokens" in p1.reason
    f.observe(p2, info(fingerprint="other", boot="x"))
    assert p2.state == "refused" and "fingerprint other" in p2.reason
    assert [n.url for n in f.serving("prefill")] == ["http://p3"] and f.ready
    f.observe(f.nodes[3], info(role="decode", weights="native", boot="q"))   # quantized arithmetic, same model
    assert f.nodes[3].state == "refused" and "weights native, the fleet bf16" in f.nodes[3].reason
    f.observe(p1, info(boot="again"))                       # restarted with a big enough pool: checked, back
    assert p1.state == "ready"


def test_down_and_draining_nodes_get_nothing():
    f = fleet()
    f.observe(f.nodes[0], None, "does not answer (ConnectError)")
    f.observe(f.nodes[1], info(boot="p2", draining=True))
    assert [n.state for n in f.nodes[:3]] == ["down", "draining", "ready"]
    for i in range(50):
        assert f.pick_prefill("alice", list(range(i, i + 80)), 16).url == "http://p3"
    f.observe(f.nodes[3], None, "gone")
    f.observe(f.nodes[4], None, "gone")
    assert not f.ready and f.pick_decode() is None


def test_plan_fleet_fixes_the_context_and_refuses_the_small_node():
    nodes = {"http://p1": ("prefill", info()), "http://p2": ("prefill", info(usable=256, boot="2")),
             "http://d1": ("decode", info("decode"))}
    chk = plan_fleet(1024, nodes, clamp=False)
    assert chk.ok and chk.usable_context == 1024 and list(chk.refused) == ["http://p2"]
    clamped = plan_fleet(1024, nodes, clamp=True)
    assert clamped.ok and clamped.usable_context == 256 and clamped.clamped and not clamped.refused
    none_left = plan_fleet(4096, nodes, clamp=False)
    assert not none_left.ok and "no decode and no prefill node passes" in none_left.note


def test_the_same_scope_and_leading_pages_go_to_the_same_prefill_node():
    f = fleet()
    system = list(range(1000, 1064))                      # 4 full pages shared by every request
    picks = {f.pick_prefill("alice", system + [7, i, i + 1], 16).url for i in range(30)}
    assert len(picks) == 1
    # another tenant's identical prompt is keyed by its own scope: its node does not depend on alice's
    bob = {f.pick_prefill("bob", system + [7, i, i + 1], 16).url for i in range(30)}
    assert len(bob) == 1
    # different prefixes spread over the nodes
    spread = Counter(f.pick_prefill("alice", [i] * 80, 16).url for i in range(300))
    assert set(spread) == set(URLS["prefill"]) and min(spread.values()) > 50, spread


def test_a_hot_prefix_is_bounded_by_load():
    f = fleet()
    ids = list(range(2000, 2080))
    home = f.pick_prefill("alice", ids, 16)
    home.in_flight = 10
    other = f.pick_prefill("alice", ids, 16)
    assert other is not home                               # past 1.25x its share: the next in its order
    home.in_flight = 0
    assert f.pick_prefill("alice", ids, 16) is home


def test_decode_goes_to_the_least_loaded_then_the_freest_node():
    f = fleet()
    d1, d2 = f.nodes[3], f.nodes[4]
    f.observe(d1, info("decode", boot="d1", free=10))
    f.observe(d2, info("decode", boot="d2", free=70))
    assert f.pick_decode() is d2
    d2.in_flight = 1
    assert f.pick_decode() is d1
    assert f.pick_decode(exclude=frozenset({"http://d1"})) is d2


def test_the_merged_snapshot_sums_pools_but_not_the_context():
    f = fleet()
    snap = _merge_snapshots(f)
    assert snap["usable_context"] == 1024                  # the fleet's, not 2 x 1024
    # every ready node's pool (prefill's prefix cache was missing); running where requests generate
    assert snap["pages_total"] == 5 * 90 and snap["pages_free"] == 5 * 80 and snap["running"] == 2
    assert snap["waiting"] == 10                           # every ready node's queue
    assert snap["tokens_computed"] == 500                  # prefill's and decode's work
    assert snap["fleet"]["prefill"]["ready"] == 3 and snap["fleet"]["decode"]["refused"] == 0


def test_round_robin_takes_the_prefill_nodes_in_turn_whatever_the_prefix():
    f = Fleet(URLS, 1024, info(), prefill_routing="round-robin")
    for n in f.nodes:
        f.observe(n, info(n.role, boot=n.url))
    ids = list(range(3000, 3080))
    assert Counter(f.pick_prefill("alice", ids, 16).url for _ in range(30)) == {u: 10 for u in URLS["prefill"]}


def test_one_odd_node_is_refused_not_the_rest():
    """The fleet's model is the one most nodes run: a lone prefill node on other weights with
    the lowest URL is refused, the others serve."""
    nodes = {"http://a-odd": ("prefill", info(fingerprint="other")), "http://p2": ("prefill", info(boot="2")),
             "http://d1": ("decode", info("decode")), "http://d2": ("decode", info("decode", boot="d2"))}
    chk = plan_fleet(1024, nodes, clamp=False)
    assert chk.ok and list(chk.refused) == ["http://a-odd"], chk.note
    # the note reaches tenants (the statement's capacity note, the start-up check's detail): it
    # counts refused nodes; their URLs and reasons are in the operator's cluster view only
    assert "1 node(s) refused" in chk.note and "a-odd" not in chk.note and "fingerprint" not in chk.note
    assert chk.to_json()["nodes"]["http://a-odd"]["refused"]


def test_a_preempted_decode_request_goes_before_new_reservations():
    """Decode reserves nothing new for a tenant while a request it preempted waits for pages
    (another tenant running fewer may go first: tests/pd/test_handoff_inprocess.py)."""
    from collections import Counter
    from types import SimpleNamespace

    from kvfence.pd.decode import KvImporter
    imp = KvImporter.__new__(KvImporter)
    imp.waiting = [SimpleNamespace(tenant="A", request_id="new", arrival=1.0)]
    imp.live, imp.pulls, imp._bypassed = {}, {}, Counter()
    imp.engine = SimpleNamespace(scheduler=SimpleNamespace(
        waiting=[SimpleNamespace(tenant="A")], running=[SimpleNamespace(tenant="A", table=[1])], max_seqs_per_tenant=8))
    assert imp._pick() is None


def test_a_node_that_refused_as_not_ready_gets_nothing_until_checked_again():
    """A restarted node refuses requests addressed to the boot the router checked; until the
    monitor's next answer passes the check, the fleet routes around it."""
    f = fleet()
    p1 = f.nodes[0]
    f.recheck(p1, "this node is boot new, the router checked boot http://p1")
    assert p1.state == "checking"
    for i in range(30):
        assert f.pick_prefill("alice", list(range(i, i + 80)), 16).url != "http://p1"
    f.observe(p1, info(usable=512, boot="new"))              # the new boot's facts fail: refused
    assert p1.state == "refused"
    f.recheck(p1, "again")                                  # only a ready node moves back to checking
    assert p1.state == "refused"
    f.observe(p1, info(boot="newer"))
    assert p1.state == "ready"


def test_a_snapshot_whose_counts_are_not_counts_is_unusable_facts():
    """Found in review: NodeInfo.snapshot was free-form, the router int()-ed and negated its
    counts, and a node answering pages_free null stopped the router's monitor thread for good
    (dead nodes stayed ready). The typed boundary now refuses it: that node is down, the rest serve."""
    import httpx
    import pytest

    from kvfence.pd.messages import SNAPSHOT_COUNTS, MessageError
    from kvfence.pd.router import _DECODE_SUMS, _info_of

    assert set(_DECODE_SUMS) <= set(SNAPSHOT_COUNTS)      # everything the merge sums is checked
    good = info().to_json()
    for bad in ({"pages_free": None}, {"running": "1"}, {"waiting": -1}, {"pages_total": 1.5}, {"preemptions": True},
                {"violations": {"I1": "x"}}, {"draining": "no"}):
        raw = {**good, "snapshot": {**good["snapshot"], **bad}}
        with pytest.raises(MessageError, match="snapshot"):
            NodeInfo.from_json(raw)
        got, why = _info_of(httpx.Response(200, json=raw))
        assert got is None and "unusable facts" in why
    f = fleet()
    f.observe(f.nodes[3], *_info_of(httpx.Response(200, json={**good, "snapshot": {"pages_free": None}})))
    assert f.nodes[3].state == "down" and f.pick_decode().url == "http://d2"
    _merge_snapshots(f)


def test_the_monitor_goes_on_after_a_round_fails(monkeypatch):
    """Whatever one round raises (a bug, a full disk under the incident log), the monitor logs
    it and polls again: it is the router's only view of its nodes."""
    import asyncio

    from kvfence.pd.router import RouterBackend

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router.fleet = fleet()
    router.poll_s, router.resolve_s = 0.01, 1e9
    calls = {"n": 0}

    def observe(node, i, why=None):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError("no space left on device")

    monkeypatch.setattr(router.fleet, "observe", observe)

    async def run():
        task = asyncio.create_task(router.run_monitor())
        for _ in range(500):
            await asyncio.sleep(0.01)
            if router.iterations >= 2:
                break
        router._stopped = True
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    assert router.iterations >= 2 and calls["n"] > 3


def test_requests_name_the_boot_that_passed_the_check_not_the_newest_seen(monkeypatch):
    """The monitor (its own thread) sets a node's info before it checks it; a request routed
    in between named the new boot as expect_boot, and a node that had restarted smaller took
    it without the router's I8 check (found in review). Requests now name checked_boot."""
    from kvfence.pd import fleet as fleet_mod

    f = fleet()
    p1 = f.nodes[0]
    assert p1.checked_boot == "http://p1"
    seen = []
    real = fleet_mod.node_problems

    def spy(*a, **kw):                        # the window: info already replaced, not yet judged
        seen.append((p1.boot_id, p1.checked_boot, p1.state))
        return real(*a, **kw)

    monkeypatch.setattr(fleet_mod, "node_problems", spy)
    f.observe(p1, info(usable=512, boot="smaller"))
    assert seen == [("smaller", "http://p1", "ready")]       # a request here names http://p1: refused there
    assert p1.state == "refused" and p1.checked_boot == "http://p1"
    f.observe(p1, info(boot="again"))
    assert p1.state == "ready" and p1.checked_boot == "again"


def test_the_router_sends_the_checked_boot(monkeypatch):
    import asyncio
    import json
    from contextlib import AsyncExitStack

    import httpx
    import pytest

    from kvfence.pd.messages import PrefillBody, WireParams
    from kvfence.pd.router import NodeError, RouterBackend

    sent = []

    class Capture:   # stands in for the router's HTTP client: records the body, then fails to connect
        def stream(self, method, url, content=None, **kw):
            sent.append(json.loads(content))
            raise httpx.ConnectError("no")

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    monkeypatch.setattr(router, "_http", lambda: Capture())
    node = fleet().nodes[0]
    node.info = info(boot="seen-not-checked")               # the monitor's window
    body = PrefillBody(request_id="r1", tenant="t", prompt_ids=[1, 2], params=WireParams())

    async def go():
        async with AsyncExitStack() as stack:
            await router._open(node, "/internal/prefill", body, stack)

    with pytest.raises(NodeError):
        asyncio.run(go())
    assert sent[0]["expect_boot"] == "http://p1"


def test_the_router_is_not_ready_the_moment_its_last_node_of_a_role_goes():
    """The monitor refreshes readiness once all of a round's polls answered; a node marked down
    by one poll (or sent back to checking by a refused request) counts at once (CI saw a 503
    after /health said ready)."""
    import asyncio

    from kvfence.engine.params import SamplingParams
    from kvfence.pd.router import RouterBackend
    from kvfence.server.backend import EngineFailed

    r = RouterBackend("http://p1", "http://d1", secret=b"s" * 32)
    f = Fleet({"prefill": ["http://p1"], "decode": ["http://d1"]}, 1024, info())
    for n in f.nodes:
        f.observe(n, info(n.role, boot=n.url))
    r.fleet, r.facts = f, {"usable_context": 1024}
    r._refresh()
    assert r.state == "ready" and r.wait_ready()
    f.observe(f.nodes[0], None, "does not answer")     # the prefill node's poll; no refresh yet
    assert r.state != "ready" and not r.wait_ready()
    with pytest.raises(EngineFailed):
        asyncio.run(r.submit([1, 2, 3], SamplingParams(max_tokens=2), "alice"))
    f.observe(f.nodes[0], info("prefill", boot="again"))
    assert r.state == "ready"
    f.recheck(f.nodes[1], "restarted")                 # a request found decode not ready
    assert r.state != "ready"


def test_the_router_says_why_at_once_when_a_node_goes_down_between_rounds():
    """Readiness counts a node marked down at once (before the monitor's next round); its
    reason must too. Before, `error` was set only by the round, so the client and /health read
    "not serving (not_ready): stopped" - the wrong story - until the round ended."""
    import asyncio

    from kvfence.engine.params import SamplingParams
    from kvfence.pd.router import RouterBackend
    from kvfence.server.engine_loop import EngineFailed

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router.fleet, router.facts = fleet(), {"usable_context": 1024}
    router._refresh()
    assert router.state == "ready" and router.error is None
    for d in router.fleet.nodes[3:]:
        router.fleet.recheck(d, "refused as not_ready")      # what a request's refusal does
    assert router.state == "not_ready"
    assert "no decode node is ready" in (router.error or "") and "refused as not_ready" in router.error
    with pytest.raises(EngineFailed, match="no decode node is ready"):
        asyncio.run(router.submit([1, 2, 3], SamplingParams(max_tokens=4), "alice"))
    router._refresh()                                         # a round saw them down
    for d in router.fleet.nodes[3:]:
        router.fleet.observe(d, info("decode", boot=d.url))   # back before the next round
    assert router.state == "not_ready" and "monitor" in (router.error or "")
    router._refresh()
    assert router.state == "ready" and router.error is None


def test_the_fleet_counts_every_node_that_went_down_or_restarted_however_briefly():
    """The state gauge alone missed a node down for a few seconds between two scrapes (found by
    a fleet probe): each entry into a state and each new boot is counted, and reach /metrics."""
    f = fleet()
    assert f.changes()["prefill"]["ready"] == 3 and f.changes()["decode"]["ready"] == 2   # the first checks
    d1 = f.nodes[3]
    f.observe(d1, None, "does not answer (ReadTimeout)")
    f.observe(d1, None, "does not answer (ReadTimeout)")           # still down: one entry
    f.observe(d1, info(role="decode", boot="d1-again"))            # back, a new boot
    f.observe(d1, info(role="decode", boot="d1-again"))            # the same boot: no restart
    assert f.changes()["decode"] == {"checking": 0, "ready": 3, "refused": 0, "down": 1, "draining": 0,
                                     "restarts": 1}
    assert f.changes()["prefill"]["restarts"] == 0
    from kvfence.server.metrics import _EngineCollector

    class Loop:
        snapshot = {**_merge_snapshots(f), "ledger_counters": {}}
        facts = None
        startup_checks: list = []
        state = "ready"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in _EngineCollector(Loop()).collect() for s in m.samples}
    assert samples[("kvfence_pd_fleet_node_changes_total", (("role", "decode"), ("state", "down")))] == 1
    assert samples[("kvfence_pd_fleet_node_restarts_total", (("role", "decode"),))] == 1


def test_mid_rotation_a_prefill_nodes_rows_go_only_to_a_decode_node_that_opens_them(caplog):
    """An operator's walkthrough: a prefill node moved to the new secret before a decode node
    accepted it had every handoff refused while both showed ready. Now a decode node is picked
    among those that accept the manifest's key id, a prefill node whose key no ready decode node
    accepts gets no request (logged once, saying what to do), and a node from before key ids
    (none listed) is taken as before."""
    old, new = "a" * 16, "b" * 16
    f = fleet()
    p1, p2, p3, d1, d2 = f.nodes
    f.observe(d1, info("decode", boot="d1", secret_key_ids=[old, new]))
    f.observe(d2, info("decode", boot="d2", secret_key_ids=[old]))
    f.observe(p1, info(boot="p1", secret_key_ids=[new, old]))
    f.observe(p2, info(boot="p2", secret_key_ids=[old]))
    for _ in range(5):
        assert f.pick_decode(seal_key=new) is d1
    assert {f.pick_decode(seal_key=old).url for _ in range(3)} <= {"http://d1", "http://d2"}
    assert f.pick_decode(seal_key="c" * 16) is None
    f.observe(d1, info("decode", boot="d1", secret_key_ids=[old]))   # d1 restarted without the new secret
    with caplog.at_level("ERROR", logger="kvfence.pd.fleet"):
        picks = {f.pick_prefill("alice", list(range(i, i + 40)), 16).url for i in range(40)}
        picks |= {f.pick_prefill("alice", list(range(i, i + 40)), 16).url for i in range(40)}
    assert "http://p1" not in picks and picks <= {"http://p2", "http://p3"}
    assert sum("seals with cluster secret key id" in r.message for r in caplog.records) == 1   # once
    assert f.ready   # p2 and p3 can still serve
    f.observe(d2, info("decode", boot="d2", secret_key_ids=[old, new]))   # step 1 done on d2
    assert any(f.pick_prefill("alice", list(range(i, i + 40)), 16).url == "http://p1" for i in range(80))
    caplog.clear()
    with caplog.at_level("ERROR", logger="kvfence.pd.fleet"):   # no decode node: not a key's fault
        f.observe(d1, None, "gone")
        f.observe(d2, None, "gone")
        assert f.pick_prefill("alice", [1] * 40, 16) is not None and f.pick_decode(seal_key=new) is None
    assert not any("seals with" in r.message for r in caplog.records)


def test_a_handoffs_newer_fields_go_only_to_a_node_that_reads_them():
    """During a rolling upgrade (the router first) a node refuses fields it does not know: the
    router leaves out the manifest's key id and the handoff's choice_of for a decode node from
    before them, and sends both to one that says it reads them."""
    import json
    import time

    from kvfence.pd.messages import DecodeBody
    from kvfence.pd.router import _json

    manifest = dict(request_id="m1", tenant="t", token_count=3, page_count=1, page_size=16, epochs=[1],
                    fingerprint="x", layout="x", boot_id="x", seal_salt="0" * 32, seal_key="0" * 16, slot_bytes=1,
                    slots=[1], lease_deadline=time.time() + 30)
    body = DecodeBody.from_json({
        "request_id": "m1", "tenant": "t", "prompt_ids": [1, 2, 3, 4], "params": {"max_tokens": 2},
        "handoff": {"manifest": manifest, "source": {"session": "h:1", "base": 0, "boot_id": "x"},
                    "choice_of": "cmpl-1"}})

    def sent(**kw) -> dict:
        return json.loads(_json(body, **kw)["content"])["handoff"]

    new = sent()
    assert new["choice_of"] == "cmpl-1" and new["manifest"]["seal_key"] == "0" * 16
    old = sent(seal_keys=False, choice_groups=False)
    assert "choice_of" not in old and "seal_key" not in old["manifest"] and old["manifest"]["slots"] == [1]
    assert "choice_of" not in sent(choice_groups=False) and sent(seal_keys=False)["choice_of"] == "cmpl-1"


def test_the_routers_choice_bound_follows_the_ready_nodes_waiting_places():
    """The router refuses prompts x n beyond the least tenant_waiting_places of its ready nodes
    (app.py): a node that joins with a smaller --max-waiting lowers it, one that goes down
    raises it again, and a node from before the field (None) lifts the bound (its 503 answers)."""
    from kvfence.pd.router import RouterBackend

    f = fleet()
    for n in f.nodes:
        f.observe(n, info(n.role, boot=n.url, tenant_waiting_places=512))
    b = RouterBackend.__new__(RouterBackend)   # only what _refresh reads
    b.fleet, b._stopped, b._tenant_of, b.facts = f, False, {}, {"usable_context": 1024}
    b.retries = Counter()
    b._refresh()
    assert b.facts["tenant_waiting_places"] == 512
    f.observe(f.nodes[3], info("decode", boot="small", tenant_waiting_places=8))
    b._refresh()
    assert b.facts["tenant_waiting_places"] == 8 and b.facts["usable_context"] == 1024
    f.observe(f.nodes[3], None, "does not answer (ConnectError)")
    b._refresh()
    assert b.facts["tenant_waiting_places"] == 512
    f.observe(f.nodes[0], info(boot="old"))   # no tenant_waiting_places: an older node
    b._refresh()
    assert b.facts["tenant_waiting_places"] is None
