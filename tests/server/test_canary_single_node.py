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


LIMITED = ("[tenants.small]\napi_keys = [\"sk-canary-small-0001\"]\nmax_prompt_tokens = 160\n"
           "[tenants.one]\napi_keys = [\"sk-canary-one-00001\"]\nmax_concurrent_requests = 1\n"
           "[tenants.free]\napi_keys = [\"sk-canary-free-0001\"]\n"
           "[metrics]\napi_keys = [\"sk-canary-scraper\"]\n")


def test_the_canary_fits_its_requests_to_each_tenants_limits(make_server):
    """A docs probe: against the README's own tenants file (a prompt cap, a concurrency of 2)
    the canary said CLEAN with its long warm-up refused and most requests 429: it had looked at
    little. It now sizes prompts and concurrency to each key's tenant_limits."""
    srv = make_server(tenants=LIMITED, scrub="none", audit_reads=True)
    keys = {"small": "sk-canary-small-0001", "one": "sk-canary-one-00001", "free": "sk-canary-free-0001"}
    r = run_canary(srv.url, keys, scrape_key=SCRAPE,
                   options=CanaryOptions(num_requests=18, warmup_requests=3, warmup_tokens=400,
                                         over_length_fraction=0.2, abort_fraction=0.0, seed=5,
                                         **{**OPTS, "concurrency": 8}))
    refused = [(q.tenant, q.error_code) for q in r.requests if q.status in (400, 429) and not q.over_length]
    assert not refused and r.clean and r.exit_code() == 0, (refused, r.text())


def test_a_server_without_tenants_is_inconclusive_not_clean(make_server):
    """Every key is tenant 'default' there: nothing was another tenant's."""
    srv = make_server(tenants=None, scrub="none", audit_reads=True)
    r = run_canary(srv.url, {"a": "sk-any-000001", "b": "sk-any-000002"},
                   options=CanaryOptions(num_requests=4, over_length_fraction=0.0, abort_fraction=0.0, seed=6,
                                         **OPTS))
    assert not r.clean and r.exit_code() == 2 and "no tenants file" in r.text(), r.text()
