"""The shipped alert rules (deploy/prometheus/kvfence-alerts.yaml) in a real Prometheus that
scrapes the real router, prefill and decode processes: every series the rules read exists,
and what the PD plane's alerts are for makes them fire (a call to a node's internal routes
without the credential, a transfer that fails verification, a fault point switched on),
while the others stay quiet."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from pd_cluster import ROOT, SCRAPE_KEY, free_port
from required_tools import tool_or_skip

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

# 300+ tokens: its pages cross to decode, where the corrupted row fails verification
LONG = "Movable type, oil-based ink and a screw press came together in a workshop in Mainz. " * 20
RULES = ROOT / "deploy" / "prometheus" / "kvfence-alerts.yaml"
# series the rules read that this cluster does not export, and why
NOT_HERE = {"kvfence_read_audit_violations_total": "only with --audit-reads",
            "kvfence_tenant_sequences": "only while a tenant has requests in flight",
            "up": "Prometheus's own"}


def rule_series() -> set[str]:
    """The metric names in the rules' expressions."""
    names: set[str] = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\b(kvfence_[a-z0-9_]+|up)\b(?=\s*[{\[)>=<]|\s*$)", rule["expr"]))
    return names


class Prometheus:
    def __init__(self, exe: str, workdir: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = workdir / "kvfence-alerts.yaml"
        shutil.copy(RULES, rules)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": [str(rules)],
                  "scrape_configs": [{"job_name": f"kvfence-{role}",
                                      "authorization": {"credentials": SCRAPE_KEY},
                                      "static_configs": [{"targets": [addr]}]}
                                     for role, addr in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen([exe, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=5)
        r.raise_for_status()
        return r.json()["data"]

    def wait(self, what: str, check, timeout: float = 40):
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = check()
            except httpx.HTTPError:
                got = None
            if got:
                return got
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"{what}: not within {timeout} s (prometheus exit {self.proc.poll()})")
            time.sleep(0.5)

    def firing(self) -> list[dict]:
        return [a for a in self.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster   # tests/pd/conftest.py


def test_the_shipped_alert_rules_fire_on_the_real_cluster(cluster, tmp_path):
    exe = tool_or_skip("prometheus", purpose="the alert rules against a real Prometheus",
                       install="Debian package 'prometheus'")
    addrs = {role: f"{cluster.hosts[role]}:{cluster.ports[role]}" for role in ("router", "prefill", "decode")}
    if cluster.url("prefill").startswith("https"):
        pytest.skip("the shared cluster runs plain HTTP on loopback")
    prom = Prometheus(exe, tmp_path, addrs)
    client = openai.OpenAI(base_url=cluster.url("router") + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        prom.wait("rules loaded", lambda: len(prom.get("/api/v1/rules")["groups"]) == 4)
        prom.wait("all three targets up", lambda: len(prom.get("/api/v1/query", query="up == 1")["result"]) == 3)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None

        # a transfer that fails verification (a failed request, counted by the router too)
        cluster.set_faults("prefill", "corrupt_staged_page")
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=model, prompt=LONG, max_tokens=2)
        # the PD plane called without the credential, twice: once with none, once with a wrong one
        for headers in ({}, {"x-kvfence-cluster-token": "0" * 64}):
            r = httpx.post(cluster.url("prefill") + "/internal/prefill", json={}, headers=headers, timeout=10)
            assert r.status_code == 401

        def fired() -> dict[str, set[str]] | None:
            by_name: dict[str, set[str]] = {}
            for a in prom.firing():
                by_name.setdefault(a["labels"]["alertname"], set()).add(a["labels"].get("instance", ""))
            want = {"KvfencePdPlaneProbed", "KvfenceTransferVerificationFailed", "KvfenceFaultInjectionActive"}
            return by_name if want <= set(by_name) else None

        by_name = prom.wait("the three alerts firing", fired)
        assert by_name["KvfencePdPlaneProbed"] == {addrs["prefill"]}
        assert by_name["KvfenceTransferVerificationFailed"] == {addrs["decode"]}
        assert by_name["KvfenceFaultInjectionActive"] == {addrs["prefill"]}
        # nothing else: no isolation violation, every process up and ready, both roles served
        assert set(by_name) == {"KvfencePdPlaneProbed", "KvfenceTransferVerificationFailed",
                                "KvfenceFaultInjectionActive"}, by_name

        # every series the rules read is one these processes export (a renamed metric would
        # leave its alert silent for good)
        names = set(prom.get("/api/v1/label/__name__/values"))
        missing = rule_series() - names - set(NOT_HERE)
        assert not missing, missing
        assert {"kvfence_pd_internal_refused_total", "kvfence_pd_fleet_nodes",
                "kvfence_time_to_first_token_seconds_bucket"} <= rule_series()
        # what runs the model is each node's own fact: the router runs none (it reported a decode node's)
        info = prom.get("/api/v1/query", query="kvfence_engine_info")["result"]
        assert sorted((s["metric"]["job"], s["metric"]["kernels"]) for s in info) == [
            ("kvfence-decode", "loaded"), ("kvfence-prefill", "loaded")], info

        # the fault point off: its alert ends at the next evaluation
        cluster.clear_faults()
        prom.wait("fault alert resolved",
                  lambda: "KvfenceFaultInjectionActive" not in {a["labels"]["alertname"] for a in prom.firing()})
    finally:
        cluster.clear_faults()
        prom.stop()
    cluster.wait_quiet(30)
