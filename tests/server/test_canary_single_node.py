"""The canary harness (kvfence/canary.py) against a single-node server: many tenants'
secrets, over-length prompts up to twice the pool, client disconnects; freed pages are not
scrubbed and the read audit is on. Every defense on: nothing found. Admission switched off
(fault points, in this process): the harness reports the over-length requests served."""
from __future__ import annotations

from kvfence import faults
from kvfence.canary import CanaryOptions, run_canary

TENANTS = "[defaults]\nmax_concurrent_requests = 64\n" + "".join(
    f'\n[tenants.tenant{i}]\napi_keys = ["sk-canary-single{i}-00"]\n' for i in range(5)) + \
    '\n[metrics]\napi_keys = ["sk-canary-scraper"]\n'   # the canary reads the node's audit at /metrics
SCRAPE = "sk-canary-scraper"
KEYS = {f"tenant{i}": f"sk-canary-single{i}-00" for i in range(5)}
OPTS = dict(concurrency=4, max_tokens=(2, 6), long_prompt_tokens=256, settle_s=20.0, timeout_s=90.0)


def test_single_node_all_defenses_on_nothing_leaks(make_server):
    srv = make_server(tenants=TENANTS, scrub="none", audit_reads=True)
    r = run_canary(srv.url, KEYS, scrape_key=SCRAPE,
                   options=CanaryOptions(num_requests=10, warmup_requests=1, warmup_tokens=400,
                                                over_length_fraction=0.3,
                                                abort_fraction=0.2, seed=3, **OPTS))
    print(r.text())
    assert r.mode == "single" and r.nodes["single"].audit_enabled
    assert r.clean and r.exit_code() == 0, r.text()
    assert any(q.over_length for q in r.requests) and not r.over_length_200
    assert any(q.status == 200 and q.text for q in r.requests)
    assert r.smallest_pool == srv.engine.facts["pool_tokens"]


def test_single_node_without_admission_the_canary_reports_over_length_200s(make_server):
    srv = make_server(tenants=TENANTS, scrub="none", audit_reads=True)
    with faults.injected("skip_router_admission", "skip_node_admission"):
        r = run_canary(srv.url, KEYS, scrape_key=SCRAPE,
                       options=CanaryOptions(num_requests=1, over_length_fraction=1.0, over_total_share=1.0,
                                                    over_total_room=(4, 8), over_total_extra=8, abort_fraction=0.0,
                                                    seed=4, **OPTS))
    print(r.text())
    assert r.over_length_200 and not r.clean and r.exit_code() == 1, r.text()
    assert not r.leaked, r.text()   # served over its own KV only: no other tenant's data
