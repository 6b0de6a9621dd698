"""A PD fleet on real processes and the real transfer engine: `kvfence launch-pd --prefill 2
--decode 2` (four nodes, one router), several tenants at once.

- greedy output through the fleet equals a single node's, and every node served traffic;
- SIGKILL of one prefill node under load: each request then either succeeds (retried on
  the other prefill node before anything reached its client) or fails with a clear error;
  requests after the kill all succeed; the survivors hold nothing afterwards; launch-pd
  restarts the killed node and the router serves from it again only once it re-checked it;
- a node whose pool is smaller than the advertised context (the incident's configuration)
  is refused with the numbers, gets no request, and the rest of the fleet serves.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from pd_cluster import ROOT

from kvfence.engine.params import SamplingParams
from kvfence.pd.seal import control_headers, load_secret
from kvfence.procs import free_ports, stop_processes

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

TENANTS = """
[tenants.alice]
api_keys = ["sk-fleet-alice-01"]

[tenants.bob]
api_keys = ["sk-fleet-bob-0001"]

[tenants.carol]
api_keys = ["sk-fleet-carol-01"]
"""
KEYS = ["sk-fleet-alice-01", "sk-fleet-bob-0001", "sk-fleet-carol-01"]
PROMPTS = ["The capital of France is", "Write a haiku about the sea.\n", "def fibonacci(n):",
           "The three primary colors are", "Once upon a time, in a small village,", "Water boils at",
           "The largest planet in the solar system is", "A good name for a cat is", "1, 2, 3, 4,",
           "The quick brown fox", "My favourite book is", "In 1969, humans first"]


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            v = pred()
            if v:
                return v
        except (httpx.HTTPError, KeyError, ValueError, StopIteration):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


class Fleet:
    def __init__(self, tmp: Path):
        self.port = free_ports(5)
        self.url = f"http://127.0.0.1:{self.port}"
        tenants = tmp / "tenants.toml"
        tenants.write_text(TENANTS)
        self.log_path = tmp / "launch.log"
        self.log = open(self.log_path, "w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_SECRET")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence.cli", "launch-pd", "--prefill", "2", "--decode", "2", "--port",
             str(self.port), "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
             "--tenants", str(tenants)], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.state = _wait(lambda: (s := self.cluster()) and s["ready"] and
                           all(n["state"] == "ready" for n in s["nodes"]) and s, 300, "the fleet")
        text = self.log_path.read_text()
        secret_file = re.search(r"made a random cluster secret for this cluster in (\S+)", text).group(1)
        self.headers = control_headers(load_secret(secret_file))   # the credential for /internal/*

    def cluster(self) -> dict:
        return httpx.get(self.url + "/v1/kvfence/cluster", timeout=5).json()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def pid(self, name: str) -> int:
        found = re.findall(rf"started {name} on port \d+ \(pid (\d+)\)", self.log_path.read_text())
        return int(found[-1])

    def info(self, url: str) -> dict:
        return httpx.get(url + "/internal/info", headers=self.headers, timeout=10).json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    f.stop()


def _complete(fleet, key, prompt, max_tokens=10):
    c = fleet.client(key)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


class Load:
    """Three client threads (one per tenant) sending requests until stopped or `limit` each;
    every outcome recorded ("ok" or "status:code:message") for the test's own thread to judge."""

    def __init__(self, fleet, limit: int, max_tokens: int):
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(fleet, k, limit, max_tokens)) for k in range(3)]
        for t in self._threads:
            t.start()

    def _run(self, fleet, k: int, limit: int, max_tokens: int) -> None:
        for i in range(limit):
            if self._stop.is_set():
                return
            try:
                _complete(fleet, KEYS[k], f"{PROMPTS[(k + i) % len(PROMPTS)]} {k}-{i}", max_tokens=max_tokens)
                self.outcomes.append("ok")
            except openai.APIStatusError as e:
                self.outcomes.append(f"{e.status_code}:{e.code}:{e.message[:120]}")
            except openai.APIConnectionError as e:      # a hang or a dropped connection: never acceptable
                self.outcomes.append(f"connection:{type(e).__name__}")

    def stop(self) -> list[str]:
        self._stop.set()
        for t in self._threads:
            t.join(300)
        return self.outcomes


def test_fleet_output_equals_single_node_and_every_node_serves(fleet, make_llm):
    nodes = fleet.cluster()["nodes"]
    assert sorted(n["role"] for n in nodes) == ["decode", "decode", "prefill", "prefill"]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i):
        try:
            results[i] = _complete(fleet, KEYS[i % 3], PROMPTS[i])
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    want = make_llm(max_model_len=1024).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    assert [results[i] for i in range(len(PROMPTS))] == [w.text for w in want]
    routed = {n["url"]: n["routed"] for n in fleet.cluster()["nodes"]}
    assert all(v > 0 for v in routed.values()), routed


def test_a_killed_prefill_node_is_routed_around_and_rejoins_after_its_check(fleet):
    before = fleet.cluster()["nodes"]
    victim = next(n for n in before if n["role"] == "prefill")
    name = "prefill" if victim["url"].endswith(f":{fleet.port + 1}") else "prefill-2"
    load = Load(fleet, limit=40, max_tokens=4)
    time.sleep(3)
    os.kill(fleet.pid(name), signal.SIGKILL)
    time.sleep(4)
    outcomes = load.stop()
    print("outcomes around the kill:", {o: outcomes.count(o) for o in set(outcomes)})
    failed = [o for o in outcomes if o != "ok"]
    assert len(failed) <= 3, outcomes                               # at most the ones caught mid-flight ...
    assert all(re.match(r"5\d\d:[a-z_]+:", o) for o in failed), failed  # ... each with a clear error code
    # right after the kill, before the node restarted: every request succeeds on the survivor
    for i in range(4):
        assert _complete(fleet, KEYS[i % 3], PROMPTS[i], max_tokens=3)
    # launch-pd restarts it; the router serves from it only after checking the new boot
    back = _wait(lambda: (n := next(x for x in fleet.cluster()["nodes"] if x["url"] == victim["url"]))
                 and n["state"] == "ready" and n["boot_id"] != victim["boot_id"] and n, 300, "the restarted node")
    assert back["usable_context"] >= fleet.cluster()["usable_context"]
    # the survivors hold nothing once the load is over
    for n in fleet.cluster()["nodes"]:
        if n["url"] == victim["url"]:
            continue
        snap = _wait(lambda n=n: (s := fleet.info(n["url"])["snapshot"]) and s["pages_owned"] == 0 and
                     s["running"] == 0 and s["pd"]["buffer_free"] == s["pd"]["buffer_rows"] and s, 60,
                     f"{n['url']} to settle")
        assert not snap["violations"], snap


def test_a_rolling_restart_under_load_loses_no_request(fleet):
    """Every node in turn is told to drain (POST /internal/drain, with the credential): it
    takes no new request, finishes its own, exits 0; launch-pd starts it again and the router
    serves from it only after checking the new boot. Meanwhile a steady load of requests of
    three tenants: none fails, and the drained nodes' last requests finish."""
    load = Load(fleet, limit=200, max_tokens=6)
    try:
        for node in fleet.cluster()["nodes"]:
            r = httpx.post(node["url"] + "/internal/drain", headers=fleet.headers, timeout=10)
            assert r.status_code == 200 and r.json()["result"] == "draining", r.text
            try:   # a second call: the same drain (unless the node is already gone)
                again = httpx.post(node["url"] + "/internal/drain", headers=fleet.headers, timeout=10)
                assert again.status_code != 200 or again.json()["result"] == "already_draining"
            except httpx.ConnectError:
                pass
            _wait(lambda node=node: (n := next(x for x in fleet.cluster()["nodes"] if x["url"] == node["url"]))
                  and n["state"] == "ready" and n["boot_id"] != node["boot_id"], 300, f"{node['url']} to come back")
    finally:
        outcomes = load.stop()
    failed = [o for o in outcomes if o != "ok"]
    assert outcomes and not failed, failed
    text = fleet.log_path.read_text()
    for name in ("prefill", "prefill-2", "decode", "decode-2"):
        assert re.search(rf"{name} exited with code 0; restarted it", text), name


def test_draining_needs_the_credential(fleet):
    node = fleet.cluster()["nodes"][0]
    r = httpx.post(node["url"] + "/internal/drain", timeout=10)
    assert r.status_code == 401
    assert next(n for n in fleet.cluster()["nodes"] if n["url"] == node["url"])["state"] == "ready"


def test_a_node_too_small_for_the_advertised_context_is_refused_and_gets_nothing(fleet, tmp_path):
    """The incident's configuration: a prefill node whose pool holds fewer tokens than the
    context the router advertises. A second router over the fleet plus that node serves
    from the rest, lists it refused with the numbers, and never routes to it."""
    port = free_ports(2)
    secret_file = re.search(r"made a random cluster secret for this cluster in (\S+)",
                            fleet.log_path.read_text()).group(1)
    small = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--role", "prefill", "--port",
                              str(port + 1), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--clamp-context",
                              "--max-model-len", "1024", "--threads", "1", "--cluster-secret-file", secret_file],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    nodes = fleet.cluster()["nodes"]
    prefill = ",".join([n["url"] for n in nodes if n["role"] == "prefill"] + [f"http://127.0.0.1:{port + 1}"])
    decode = ",".join(n["url"] for n in nodes if n["role"] == "decode")
    log = open(tmp_path / "router.log", "w+")
    router = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--role", "router", "--port", str(port),
                               "--prefill-url", prefill, "--decode-url", decode, "--max-model-len", "1024",
                               "--cluster-secret-file", secret_file, "--node-wait", "120"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        state = _wait(lambda: (s := httpx.get(url + "/v1/kvfence/cluster", timeout=5).json()) and s["ready"] and
                      any(n["state"] == "refused" for n in s["nodes"]) and s, 240, "the second router")
        refused = [n for n in state["nodes"] if n["state"] == "refused"]
        assert [n["url"] for n in refused] == [f"http://127.0.0.1:{port + 1}"]
        assert "exceeds the prefill node's usable capacity" in refused[0]["reason"], refused
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        for p in PROMPTS[:6]:
            assert c.completions.create(model=model, prompt=p, max_tokens=3, temperature=0).choices
        after = httpx.get(url + "/v1/kvfence/cluster", timeout=5).json()["nodes"]
        assert next(n for n in after if n["state"] == "refused")["routed"] == 0
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert 'kvfence_pd_fleet_nodes{role="prefill",state="refused"} 1.0' in metrics
    finally:
        stop_processes([router, small], grace_s=20)
