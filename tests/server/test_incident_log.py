"""The incident log on a real server: a read of another tenant's page is refused, and the
record (with the tenant whose data it was) is on disk before the client sees its error;
no prompt or completion text ever reaches the log; the disclosure report reads it."""
from __future__ import annotations

import json
import threading
import uuid

import httpx
import openai
import pytest
from server_harness import MODEL

from kvfence import disclosure, incidents


@pytest.fixture
def log_path(tmp_path):
    path = tmp_path / "incidents-single-0.jsonl"
    incidents.open_log(path, "single", boot_id="test-boot")
    yield path
    incidents.close_log()


def test_a_refused_cross_tenant_read_is_on_record_before_the_error(make_server, log_path):
    srv = make_server()
    canary_a, canary_b = f"CANARY-{uuid.uuid4().hex[:12]}", f"CANARY-{uuid.uuid4().hex[:12]}"
    kw = dict(model=MODEL, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    bob_prompt = f"Bob's secret is {canary_b}. Now count:" + " one two three four five" * 6
    clean = srv.client("bob").completions.create(prompt=bob_prompt, **kw).choices[0].text
    results: dict = {}

    def bob():
        results["bob"] = srv.client("bob").completions.create(prompt=bob_prompt, **kw).choices[0].text

    srv.spy.step_delay = 0.05   # bob still runs when alice comes, however fast the machine (~3 s)
    t = threading.Thread(target=bob)
    t.start()
    # alice's first page is swapped for bob's (a read of his KV) once both are running
    for _ in range(200):
        if srv.engine.snapshot.get("running", 0) >= 1:
            break
        threading.Event().wait(0.02)
    srv.spy.foreign_tenants.add("alice")
    try:
        with pytest.raises(openai.InternalServerError) as e:
            srv.client("alice").completions.create(
                prompt=f"Alice's secret is {canary_a}. Tell me a story about it.", **kw)
    finally:
        srv.spy.step_delay = 0.0
    # the client has its error: the record must already be on disk
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    t.join(60)
    assert e.value.code == "isolation_violation"
    refusals = [r for r in records if r["kind"] == "ledger_refusal"]
    assert len(refusals) == 1, records
    r = refusals[0]
    assert r["tenant"] == "alice" and r["involved_tenants"] == ["bob"] and r["invariant"] == "I2"
    assert r["client"]["status"] == 500 and r["client"]["code"] == "isolation_violation"
    assert r["role"] == "single" and r["boot_id"] == "test-boot" and len(r["pages"]) == 1
    assert results["bob"] == clean          # the bystander whose page it was is untouched
    text = log_path.read_text()
    for secret in (canary_a, canary_b, "secret", "story", clean.strip()[:20]):
        assert secret not in text
    assert incidents.verify(log_path).ok
    rep = disclosure.build([log_path])
    assert rep["tenants"]["alice"]["as_requester"] == [r["request_id"]]
    assert rep["tenants"]["bob"]["as_owner"] == [r["request_id"]]
    assert rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no"
    # the isolation statement points at the log and its last hash
    stmt = httpx.get(srv.url + "/v1/kvfence/isolation", headers={"authorization": "Bearer sk-bob-00000001"},
                     timeout=10).json()
    log = stmt["incident_disclosure"]["incident_log"]
    assert log["records_this_boot"] == 1 and log["last_hash"] == incidents.verify(log_path).last_hash
    # a tenant is not told where the log lives on the host, nor how loaded the pool is
    assert "path" not in log and str(log_path) not in json.dumps(stmt) and stmt["audience"] == "tenant"
    assert "tenants_configured" not in stmt["kv_memory_isolation"]["tenancy"] and "pages_free" not in stmt["live"]
