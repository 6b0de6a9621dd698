"""The canary harness (kvfence/canary.py) against a real PD cluster: can it fail, and does it?

One cluster (prefill, decode, router processes; --scrub none so freed pages keep earlier
tenants' KV; --audit-reads, the strong oracle) serves every case; faults are switched
over HTTP between runs.

  all defenses on                 nothing found (no foreign canary, no audit violation, no
                                  over-length 200, every page and row back, nothing hung),
                                  though the decode node is killed and restarted mid-run
  all defenses off together       the incident end to end: the canary DETECTS it (the audit
                                  sees reads of unwritten, reserved pages; any canary that
                                  shows up in a response is reported)
  each single layer off           the other layers still stop every leak (defense in depth)
  only one layer on               that layer alone keeps every tenant's KV private
"""
from __future__ import annotations

import os
from unittest import mock

import httpx
import pytest
from pd_cluster import NODE_ARGS, SCRAPE_KEY, Cluster

from kvfence.canary import CanaryOptions, NodeKill, run_canary
from kvfence.pd.seal import SECRET_ENV
from kvfence.procs import stop_processes

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

TENANTS = 6
TENANTS_TOML = "[defaults]\nmax_concurrent_requests = 64\n" + "".join(
    f'\n[tenants.tenant{i}]\napi_keys = ["sk-canary-tenant{i}-0000"]\n' for i in range(TENANTS)) + \
    f'\n[metrics]\napi_keys = ["{SCRAPE_KEY}"]\n'    # the router's nodes, for the canary and the harness

# The incident's path, one fault per defense layer: role -> faults that switch the layer off.
LAYERS = {
    "router admission (I4)": {"router": "skip_router_admission"},
    "prefill admission (I4, no placeholder handoff)": {"prefill": "handoff_placeholder"},
    "decode admission (I4)": {"decode": "skip_node_admission"},
    "manifest check (I4, I5)": {"decode": "skip_manifest_check"},
    "verified token count (I3)": {"decode": "attend_reserved_length"},
    "written watermark (I3)": {"prefill": "skip_watermark", "decode": "skip_watermark"},
    "ledger check (I2, I3)": {"prefill": "skip_ledger_check", "decode": "skip_ledger_check"},
}


def merged(layers) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    for name in layers:
        for role, spec in LAYERS[name].items():
            out.setdefault(role, []).append(spec)
    return {role: ",".join(specs) for role, specs in out.items()}


ALL_OFF = merged(LAYERS)


class CanaryCluster(Cluster):
    """The PD harness with what the canary needs: a tenants file on the router, freed pages
    left unscrubbed, and the read audit on every node."""

    def __init__(self, workdir):
        tenants = workdir / "tenants.toml"
        tenants.write_text(TENANTS_TOML)
        self.tenants_file = tenants
        super().__init__(workdir, node_args=NODE_ARGS + ["--scrub", "none", "--audit-reads"],
                         router_args=["--tenants", str(tenants)])

    def stop(self) -> None:
        """As Cluster.stop, but a node that ignores SIGTERM for 5 s is killed (keeps CI short)."""
        stop_processes(self.procs.values(), grace_s=5, wake=True)

    def apply(self, faults: dict[str, str]) -> None:
        for role in ("prefill", "decode", "router"):
            self.set_faults(role, faults.get(role, ""))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = CanaryCluster(tmp_path_factory.mktemp("canary")).start_all()
    yield c
    c.stop()


@pytest.fixture
def cl(cluster):
    cluster.clear_faults()
    cluster.wait_quiet(30)
    yield cluster
    cluster.clear_faults()


def canary(c: CanaryCluster, opts: CanaryOptions, **kw):
    with mock.patch.dict(os.environ, {SECRET_ENV: c.secret}):   # the harness reads the nodes' internal API
        report = run_canary(c.url("router"), c.tenants_file, opts, **kw)
    print(report.text())
    return report


SMALL = dict(concurrency=4, max_tokens=(2, 6), long_prompt_tokens=256, settle_s=25.0, timeout_s=90.0)


def test_all_defenses_on_nothing_leaks_even_when_decode_dies(cl):
    """Every layer on, and the decode node SIGKILLed mid-run and restarted: requests in
    flight fail cleanly, nothing leaks, and both nodes end with every page and row back."""
    def restart(role):
        cl.start(role)
        cl.wait_ready(180)

    r = canary(cl, CanaryOptions(num_requests=12, over_length_fraction=0.3, abort_fraction=0.2, seed=11,
                                 restart_wait_s=180.0, **SMALL),
               kills=[NodeKill("decode", 3.0, "signal")], procs=cl.procs, restart=restart)
    assert r.clean and r.exit_code() == 0, r.text()
    assert all(n.audit_enabled for n in r.nodes.values())
    assert r.kills and "rejoined" in r.kills[0] and r.nodes["decode"].restarts == 1, r.text()
    assert any(q.over_length for q in r.requests)           # over-length requests were sent ...
    assert all(q.status != 200 for q in r.requests if q.over_length)  # ... and none was served
    assert any(q.status == 200 and q.text for q in r.requests)  # ordinary ones were answered
    after = [q for q in r.requests if q.after_kill]
    assert after and all(q.status == (400 if q.over_length else 200) for q in after if not q.client_aborted), \
        r.text()                                            # the restarted node serves, and still refuses


def test_all_defenses_off_the_canary_detects_the_leak(cl):
    """The incident end to end: over-length requests pass the router and prefill (a
    one-token placeholder is handed off), decode takes the handoff, trusts the reserved
    length and attends pages that hold earlier tenants' KV (scrub none; warmed up with
    canary prompts first). The audit must see it; canaries in responses are reported."""
    cl.apply(ALL_OFF)
    r = canary(cl, CanaryOptions(num_requests=6, concurrency=1, warmup_requests=1, over_length_fraction=0.85,
                                 over_total_share=1.0, over_total_room=(12, 24), over_total_extra=16,
                                 probe_fraction=0.15, abort_fraction=0.0, max_tokens=(2, 6), long_prompt_tokens=320,
                                 settle_s=25.0, timeout_s=90.0, seed=5))
    assert r.leaked and not r.clean and r.exit_code() == 1, r.text()
    dec = r.nodes["decode"]
    assert dec.audit_by_kind.get("read_unwritten", 0) > 0, r.text()
    assert r.over_length_200, r.text()                      # the incident: over-length answered 200
    metrics = httpx.get(cl.url("decode") + "/metrics", timeout=10).text
    assert 'kvfence_read_audit_violations_total{kind="read_unwritten"}' in metrics
    seen = sorted({(lk.reader, lk.owner, lk.canary, lk.match) for lk in r.leaks})
    print(f"foreign canaries seen in responses: {len(r.leaks)} {seen}")


@pytest.mark.parametrize("layer", list(LAYERS))
def test_each_single_layer_off_the_others_stop_every_leak(cl, layer):
    cl.apply(merged([layer]))
    # no client aborts here (the all-on run has them): an abandoned request's prefill rows stay
    # fenced for lease + max pull + skew, and waiting that out 7 times costs CI a minute
    r = canary(cl, CanaryOptions(num_requests=6, over_length_fraction=0.5, abort_fraction=0.0, seed=21, **SMALL))
    assert not r.leaks and r.audit_violations == 0 and not r.over_length_200, r.text()
    assert r.clean, r.text()


@pytest.mark.parametrize("layer", [n for n in LAYERS if n != "written watermark (I3)"])
def test_only_one_layer_on_still_keeps_kv_private(cl, layer):
    """Every layer but one switched off: that one alone stops the cross-tenant read. (The
    ledger check includes the watermark, so 'ledger check' here leaves both on.) Without any
    admission the verified-count layer serves over-length prompts, computing them itself: a
    200, but over the request's own KV only; the ledger check aborts the request after decode
    admitted it (a streamed 200 that ends in an isolation_violation error)."""
    rest = [n for n in LAYERS
            if n != layer and not (layer == "ledger check (I2, I3)" and n == "written watermark (I3)")]
    cl.apply(merged(rest))
    r = canary(cl, CanaryOptions(num_requests=4, over_length_fraction=1.0, over_total_share=1.0, abort_fraction=0.0,
                                 concurrency=2, max_tokens=(2, 4), over_total_room=(4, 8), settle_s=25.0,
                                 timeout_s=90.0, seed=31))
    assert not r.leaks and r.audit_violations == 0, r.text()
    assert not r.hung and not r.pages_not_returned, r.text()
    if layer not in ("verified token count (I3)", "ledger check (I2, I3)"):
        assert not r.over_length_200, r.text()   # an admission layer: refused before any stream opened
