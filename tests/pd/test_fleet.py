"""A PD fleet on real processes and the real transfer engine: `kvfence launch-pd --prefill 2
--decode 2` (four nodes, one router), several tenants at once.

- greedy output through the fleet equals a single node's, and every node served traffic;
- SIGKILL of one prefill node under load: each request then either succeeds (retried on
  the other prefill node before anything reached its client) or fails with a clear error;
  requests after the kill all succeed; the survivors hold nothing afterwards; launch-pd
  restarts the killed node and the router serves from it again only once it re-checked it;
- a node whose pool is smaller than the advertised context (the incident's configuration)
  is refused with the numbers, gets no request, and the rest of the fleet serves;
- two routers in front of the same nodes (launch-pd's and a second `serve --role router`
  process; nothing shared but the nodes): both list every node ready, both serve the single
  node's output to several tenants at once, a tenant's concurrency limit holds per router,
  and when one router is SIGKILLed mid-load the other keeps serving while the nodes abort
  the dead router's requests and get back everything they held; a router stopped with
  SIGTERM finishes its streams first.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest
from pd_cluster import ROOT

from kvfence.canary import CanaryOptions, run_canary
from kvfence.cli import main
from kvfence.engine.params import SamplingParams
from kvfence.pd.seal import SECRET_FILE_ENV, control_headers, load_secret, new_secret
from kvfence.procs import free_ports, stop_processes

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

TENANTS = """
[tenants.alice]
api_keys = ["sk-fleet-alice-01"]

[tenants.bob]
api_keys = ["sk-fleet-bob-0001"]

[tenants.carol]
api_keys = ["sk-fleet-carol-01"]

[metrics]
api_keys = ["sk-fleet-scraper1"]

[operator]
api_keys = ["sk-fleet-operator"]
"""
SCRAPE = {"Authorization": "Bearer sk-fleet-scraper1"}
OPERATOR = {"Authorization": "Bearer sk-fleet-operator"}   # the router's per-node state is the operator's
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
    """`kvfence launch-pd` with `prefill` + `decode` nodes; `extra`: more launch-pd flags;
    `secret_file`: the cluster secret to give it (default: launch-pd makes one); `wait`: return
    only once the fleet is ready (else call wait_ready)."""

    def __init__(self, tmp: Path, prefill: int = 2, decode: int = 2, extra=(), tenants: str = TENANTS,
                 secret_file: Path | None = None, wait: bool = True):
        self.port = free_ports(1 + prefill + decode)
        self.url = f"http://127.0.0.1:{self.port}"
        # launch-pd's layout: prefill nodes on the ports after the router's, then decode nodes
        self.node_urls = {"prefill": [f"http://127.0.0.1:{self.port + i}" for i in range(1, prefill + 1)],
                          "decode": [f"http://127.0.0.1:{self.port + prefill + i}" for i in range(1, decode + 1)]}
        self.tenants_file = tmp / "tenants.toml"
        self.tenants_file.write_text(tenants)
        self.log_path = tmp / "launch.log"
        self.log = open(self.log_path, "w+")
        self.secret_file = None if secret_file is None else str(secret_file)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_SECRET")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence.cli", "launch-pd", "--prefill", str(prefill), "--decode", str(decode),
             "--port", str(self.port), "--dtype", "bfloat16", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
             "--tenants", str(self.tenants_file), *extra,
             *(["--cluster-secret-file", self.secret_file] if self.secret_file else [])],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        try:
            self.state = _wait(lambda: self.proc.poll() is None and (s := self.cluster()) and s["ready"] and
                               all(n["state"] == "ready" for n in s["nodes"]) and s, 300, "the fleet")
        except BaseException:
            self.stop()   # never leave a half-started fleet running
            raise
        if self.secret_file is None:
            text = self.log_path.read_text()
            self.secret_file = re.search(r"made a random cluster secret for this cluster in (\S+)", text).group(1)
        self.headers = control_headers(load_secret(self.secret_file))   # the credential for /internal/*

    def cluster(self) -> dict:
        return httpx.get(self.url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=5).json()

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
    # the read audit on every node: launch-pd passes it on (it once dropped the flag), and the
    # canary below counts what it saw on each node
    f = Fleet(tmp_path_factory.mktemp("fleet"), extra=("--audit-reads",))
    yield f
    f.stop()


@pytest.fixture(scope="module")
def single_node(make_llm) -> dict[str, str]:
    """Greedy 10-token completions of PROMPTS on one in-process node: what the fleet must give."""
    out = make_llm(max_model_len=1024).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    return dict(zip(PROMPTS, (o.text for o in out), strict=True))


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


def test_fleet_output_equals_single_node_and_every_node_serves(fleet, single_node):
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
    assert [results[i] for i in range(len(PROMPTS))] == [single_node[p] for p in PROMPTS]
    routed = {n["url"]: n["routed"] for n in fleet.cluster()["nodes"]}
    assert all(v > 0 for v in routed.values()), routed


def test_the_canary_audits_every_node_of_the_fleet(fleet):
    """Found in review: the canary looked at the first node of each role only, so a leak seen
    by the audit on a fleet's second decode node still gave CLEAN."""
    with mock.patch.dict(os.environ, {SECRET_FILE_ENV: fleet.secret_file}):
        r = run_canary(fleet.url, fleet.tenants_file, CanaryOptions(
            num_requests=8, concurrency=3, warmup_requests=0, max_tokens=(2, 4), long_prompt_tokens=200,
            settle_s=25.0, timeout_s=90.0, seed=3))
    print(r.text())
    assert set(r.nodes) == {"prefill", "prefill-2", "decode", "decode-2"}, r.text()
    assert {n.url for n in r.nodes.values()} == set(fleet.node_urls["prefill"] + fleet.node_urls["decode"])
    assert all(n.audit_enabled and n.settled for n in r.nodes.values()), r.text()
    assert r.clean and r.exit_code() == 0, r.text()


def test_a_tenant_reaching_a_node_cannot_generate_there(fleet):
    """launch-pd gives every node the tenants file (for its status routes), yet a tenant's key
    generates only through the router: on a node's own /v1 it would skip the router's limits and
    the scope stamps that keep a reload's retirement (found in review)."""
    key = {"Authorization": f"Bearer {KEYS[0]}"}
    for url in fleet.node_urls["prefill"] + fleet.node_urls["decode"]:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/responses", {"input": "hi"})):
            r = httpx.post(url + path, json=body, headers=key, timeout=10)
            assert r.status_code == 404, (url, path, r.status_code, r.text[:200])
        assert httpx.get(url + "/metrics", headers=SCRAPE, timeout=10).status_code == 200   # still the file's
        assert httpx.get(url + "/metrics", headers=key, timeout=10).status_code == 401


def test_a_tenant_learns_whether_the_fleet_is_up_but_not_where_its_nodes_are(fleet):
    # found in review: the router's cluster route named every node's URL, pool and load to
    # anyone who could reach it, tenants included
    for headers in ({}, {"Authorization": f"Bearer {KEYS[0]}"}):
        body = httpx.get(fleet.url + "/v1/kvfence/cluster", headers=headers, timeout=5).json()
        assert body["ready"] is True and set(body) == {"ready", "usable_context", "detail"}, body
        assert "127.0.0.1" not in json.dumps(body)
    assert len(fleet.cluster()["nodes"]) == 4


def test_a_tenant_removed_from_the_routers_file_leaves_no_cached_prefix_on_the_prefill_nodes(fleet):
    """The router's reload retires the removed tenant's cache scope on every prefill node: a
    tenant given the name later starts with nothing cached (mutant: the router tells no node)."""
    prompt = ("Our company handbook, section one: every employee receives a laptop, a badge and a desk. "
              "Section two: holidays are requested two weeks ahead. Section three says that") * 2

    def cached(key: str) -> int:
        c = fleet.client(key)
        r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    def reload(text: str) -> dict:
        fleet.tenants_file.write_text(text)
        r = httpx.post(fleet.url + "/v1/kvfence/tenants/reload", headers=OPERATOR, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    carol = KEYS[2]
    try:
        cached(carol)
        assert cached(carol) >= 32     # routed by her scope to the prefill node that cached it
        change = reload(TENANTS.replace(f'[tenants.carol]\napi_keys = ["{carol}"]\n', ""))
        assert change["removed"] == ["carol"] and change["prefix_pages_retired"] >= 2, change
        assert reload(TENANTS.replace(carol, "sk-fleet-carol-02"))["added"] == ["carol"]
        assert cached("sk-fleet-carol-02") == 0
    finally:   # back to TENANTS by SIGHUP to launch-pd, which passes it on to every process
        fleet.tenants_file.write_text(TENANTS)
        fleet.proc.send_signal(signal.SIGHUP)

    def works(key: str) -> bool:
        return httpx.get(fleet.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code \
            == 200

    _wait(lambda: works(carol) and not works("sk-fleet-carol-02"), 30, "the fleet to reload on SIGHUP")
    assert fleet.proc.poll() is None and all(n["state"] == "ready" for n in fleet.cluster()["nodes"])


def test_a_killed_prefill_node_is_routed_around_and_rejoins_after_its_check(fleet):
    before = fleet.cluster()["nodes"]
    victim = next(n for n in before if n["role"] == "prefill")
    name = "prefill" if victim["url"].endswith(f":{fleet.port + 1}") else "prefill-2"
    load = Load(fleet, limit=10_000, max_tokens=4)   # until stopped: a fast machine must not run out
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


def test_a_rolling_restart_under_load_loses_no_request(fleet, capsys):
    """A node of each role in turn is told to drain (POST /internal/drain, with the
    credential): it takes no new request, finishes its own, exits 0; launch-pd starts it
    again and the router serves from it only after checking the new boot. Meanwhile a steady
    load of requests of three tenants: none fails, and the drained nodes' last requests
    finish. (One node per role: every node's restart is the same path, ~25 s each here.)"""
    restarted = {"prefill": fleet.node_urls["prefill"][0], "decode-2": fleet.node_urls["decode"][1]}
    load = Load(fleet, limit=10_000, max_tokens=6)   # until stopped, through both restarts
    try:
        for i, url in enumerate(restarted.values()):
            node = next(n for n in fleet.cluster()["nodes"] if n["url"] == url)
            if i == 0:   # the operator's command (docs/pd.md), waiting for the node to be done, then the route
                capsys.readouterr()
                assert main(["drain", "--port", url.rsplit(":", 1)[1], "--cluster-secret-file",
                             fleet.secret_file, "--wait", "300"]) == 0
                said = capsys.readouterr().out
                print(said)
                assert "is draining" in said and "drain: the node has exited" in said, said
            else:
                r = httpx.post(node["url"] + "/internal/drain", headers=fleet.headers, timeout=10)
                assert r.status_code == 200 and r.json()["result"] == "draining", r.text
            try:   # a second call: the same drain (unless the node is already gone)
                again = httpx.post(node["url"] + "/internal/drain", headers=fleet.headers, timeout=10)
                assert again.status_code != 200 or again.json()["result"] == "already_draining"
            except httpx.TransportError:
                pass   # an idle node exits at once: refused, or closed while the call was in flight
            _wait(lambda node=node: (n := next(x for x in fleet.cluster()["nodes"] if x["url"] == node["url"]))
                  and n["state"] == "ready" and n["boot_id"] != node["boot_id"], 300, f"{node['url']} to come back")
    finally:
        outcomes = load.stop()
    failed = [o for o in outcomes if o != "ok"]
    assert outcomes and not failed, failed
    text = fleet.log_path.read_text()
    for name in restarted:
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
                              str(port + 1), "--dtype", "bfloat16", "--kv-cache-memory", "4MiB", "--clamp-context",
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


# -- two routers in front of the same nodes -----------------------------------------------------------------
# A second launch-pd fleet (1 prefill + 1 decode) with short leases, so what a killed router's
# requests held comes back within seconds: a hold without an ACK is fenced until lease + max
# pull + skew (8 + 3 + 0.5 s here; 106 s with the defaults). A second router process over its
# nodes shares nothing with the first but the nodes, the tenants file and the cluster secret.
DAVE = "sk-fleet-dave-0001"
ERIN = "sk-fleet-erin-0001"
TWO_ROUTER_TENANTS = TENANTS + f"""
[tenants.dave]
api_keys = ["{DAVE}"]
max_concurrent_requests = 1

[tenants.erin]
api_keys = ["{ERIN}"]
requests_per_minute = 2
"""
SHORT_LEASES = ["--lease", "8", "--max-pull", "3", "--clock-skew", "0.5", "--transfer-timeout", "2",
                "--decode-reserve-tokens", "32", "--max-waiting", "16"]   # a tenant's places: 8


class Router:
    """`kvfence serve --role router` over a fleet's nodes, on its own port: the same tenants
    file and cluster secret as the fleet's own router, nothing else shared. It may start
    before the nodes are up (it waits for them); wait_ready returns once it checked them all."""

    def __init__(self, fleet: Fleet, log_path: Path):
        assert fleet.secret_file is not None
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_SECRET")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence.cli", "serve", "--role", "router", "--port", str(self.port),
             "--prefill-url", ",".join(fleet.node_urls["prefill"]), "--decode-url", ",".join(fleet.node_urls["decode"]),
             "--max-model-len", "1024", "--tenants", str(fleet.tenants_file), "--cluster-secret-file",
             fleet.secret_file, "--node-wait", "240"], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        try:
            _wait(lambda: self.proc.poll() is None and (s := self.cluster()) and s["ready"] and
                  all(n["state"] == "ready" for n in s["nodes"]), 300, "the second router")
        except BaseException:
            self.stop()
            raise

    def cluster(self) -> dict:
        return httpx.get(self.url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=5).json()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        stop_processes([self.proc], grace_s=20)


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    """(the fleet, whose own router is router A; routers B and C, separate processes over its
    nodes). C is there to be stopped with SIGTERM, B to be killed."""
    tmp = tmp_path_factory.mktemp("two-routers")
    secret = tmp / "cluster.secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # only this user can read it
    with os.fdopen(fd, "w") as out:
        out.write(new_secret() + "\n")
    f = Fleet(tmp, prefill=1, decode=1, extra=SHORT_LEASES, tenants=TWO_ROUTER_TENANTS, secret_file=secret,
              wait=False)
    started: list[Router] = []
    try:
        for name in ("b", "c"):   # they start while the nodes load: they wait for them
            started.append(Router(f, tmp / f"router-{name}.log"))
        f.wait_ready()
        for r in started:
            r.wait_ready()
        yield f, *started
    finally:
        for r in started:
            r.stop()
        f.stop()


def _at_baseline(fleet: Fleet, url: str) -> dict | None:
    """The node's snapshot if nothing is owned, running, waiting, held, fenced or quarantined
    and every pool page is free or in the prefix cache (reclaimable); else None."""
    s = fleet.info(url)["snapshot"]
    pd = s["pd"]
    ok = (s["pages_owned"] == 0 and s["pages_quarantined"] == 0 and s["running"] == 0 and s["waiting"] == 0
          and s["pages_free"] + s["pages_shared"] == s["pages_total"] and pd["buffer_free"] == pd["buffer_rows"]
          and not pd.get("held") and not pd.get("pending"))
    return s if ok else None


def _settle(fleet: Fleet, timeout: float = 60) -> dict[str, dict]:
    """Every node of the fleet back at baseline (bounded wait); their snapshots, with no violation."""
    snaps = {n["url"]: _wait(lambda n=n: _at_baseline(fleet, n["url"]), timeout, f"{n['url']} to settle")
             for n in fleet.cluster()["nodes"]}
    for url, snap in snaps.items():
        assert not snap["violations"], (url, snap["violations"])
    return snaps


def _every_node_ready(router) -> dict[str, str]:
    """url -> boot id of every node the router lists, each of them ready."""
    state = router.cluster()
    assert state["ready"], state
    assert all(n["state"] == "ready" for n in state["nodes"]), state["nodes"]
    return {n["url"]: n["boot_id"] for n in state["nodes"]}


def test_two_routers_over_the_same_nodes_both_serve(routers, single_node):
    """Router A (launch-pd's) and router B (a separate process) list the same nodes, each
    ready with the same boot; concurrent requests of three tenants through both give the
    single node's greedy output; both routers routed to every node; nothing stays held."""
    fleet, b, c = routers
    assert _every_node_ready(fleet) == _every_node_ready(b) == _every_node_ready(c)
    assert sorted(n["role"] for n in b.cluster()["nodes"]) == ["decode", "prefill"]
    before = _settle(fleet)
    by_name = {"a": fleet, "b": b}
    jobs = [(r, KEYS[i % 3], p) for i, p in enumerate(PROMPTS) for r in by_name]   # 24: each prompt on both
    results: dict[tuple[str, str], str] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:   # 6 workers: each (router, tenant) pair, a bounded share of the jobs
        for r, key, p in jobs[w::6]:
            try:
                results[(r, p)] = _complete(by_name[r], key, p)
            except BaseException as e:   # noqa: BLE001 - reported on the test's thread
                errors.append(e)
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not errors, errors
    assert len(results) == len(jobs)
    for (r, p), text in sorted(results.items()):
        assert text == single_node[p], (r, p, text, single_node[p])
    for r in by_name.values():   # both routers answered, and each routed to every node
        routed = {n["url"]: n["routed"] for n in r.cluster()["nodes"]}
        assert all(v > 0 for v in routed.values()), (r.url, routed)
    after = _settle(fleet)
    for url, snap in after.items():
        assert snap["pages_total"] == before[url]["pages_total"]
        assert snap["pd"]["buffer_rows"] == before[url]["pd"]["buffer_rows"]
    assert _every_node_ready(fleet) == _every_node_ready(b)


def _open_stream(router, key: str, max_tokens: int = 400):
    """A streaming completion that keeps its tenant's slot on that router until closed:
    returns (the stream, its first chunk)."""
    c = router.client(key)
    stream = c.completions.create(model=c.models.list().data[0].id, prompt="Tell me a long story about the sea.",
                                  max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
    return stream, next(iter(stream))


def test_a_tenants_concurrency_limit_is_per_router(routers):
    """dave may have 1 request in flight. With one streaming through router A, a second
    through A is refused (429), while one through router B is admitted and streams: the
    limit is enforced by each router alone (docs/pd.md, "Two routers")."""
    fleet, b, _ = routers
    first, chunk = _open_stream(fleet, DAVE)
    try:
        assert chunk.choices[0].text is not None
        with pytest.raises(openai.RateLimitError) as refused:
            _open_stream(fleet, DAVE, max_tokens=4)
        assert refused.value.code == "tenant_max_concurrent_requests"
        other, chunk_b = _open_stream(b, DAVE)    # the same tenant, the other router: admitted
        try:
            assert chunk_b.choices[0].text is not None
            with pytest.raises(openai.RateLimitError):   # and B enforces its own 1
                _open_stream(b, DAVE, max_tokens=4)
        finally:
            other.close()
    finally:
        first.close()   # both clients leave mid-stream: the nodes abort the requests
    _settle(fleet)


def test_a_tenants_requests_per_minute_is_per_router(routers):
    """erin may send 2 requests a minute. Through router A the third is refused (429, and
    the Retry-After a client needs), through router B it is served; B counts its own 2."""
    fleet, b, _ = routers

    def ask(router):
        c = router.client(ERIN)
        return c.completions.create(model=c.models.list().data[0].id, prompt="Hi", max_tokens=2, temperature=0)

    assert ask(fleet).usage and ask(fleet).usage
    with pytest.raises(openai.RateLimitError) as refused:
        ask(fleet)
    assert refused.value.code == "tenant_requests_per_minute"
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert ask(b).usage and ask(b).usage    # the other router: its own minute
    with pytest.raises(openai.RateLimitError):
        ask(b)
    _settle(fleet)


def test_the_router_refuses_more_choices_than_a_tenant_may_queue_on_its_nodes(routers):
    """The nodes run --max-waiting 16: a tenant may have 8 requests waiting on each, and a
    request's choices wait together there. The router takes the nodes' number: its model card
    says 8, and n=9 is a 400 naming n (it was a 503 on every retry), before any node sees it."""
    fleet, b, _ = routers
    for router in (fleet, b):
        c = router.client(KEYS[0] if router is fleet else KEYS[1])
        model = c.models.list().data[0]
        assert model.model_dump()["max_choices"] == 8
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model.id, prompt="Hi there", max_tokens=2, n=9, temperature=0.7)
        assert e.value.code == "too_many_choices" and e.value.param == "n" and "at most 8" in e.value.message
    _settle(fleet)


class StreamLoad:
    """Streaming clients (one per tenant) on one router until stopped, `limit` each, or their
    first failure; `streaming` is set once some stream has received tokens. Outcomes: "ok",
    "cut:N" (the stream broke after N chunks with text), or what went wrong before any token."""

    def __init__(self, router, limit: int, max_tokens: int):
        self.outcomes: list[str] = []
        self.streaming = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(router, k, limit, max_tokens)) for k in range(3)]
        for t in self._threads:
            t.start()

    def _run(self, router, k: int, limit: int, max_tokens: int) -> None:
        c = router.client(KEYS[k])
        model = c.models.list().data[0].id
        for i in range(limit):
            if self._stop.is_set():
                return
            got = 0
            try:
                for chunk in c.completions.create(model=model, prompt=f"{PROMPTS[(k + i) % len(PROMPTS)]} {k}-{i}",
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True}):
                    if chunk.choices and chunk.choices[0].text:
                        got += 1
                        self.streaming.set()
                self.outcomes.append("ok")
            except Exception as e:   # noqa: BLE001 - a dead router: the stream breaks, or nothing answers
                self.outcomes.append(f"cut:{got}" if got else f"error:{type(e).__name__}")
                return   # this client's router is gone (the test judges whether it should be)

    def stop(self) -> list[str]:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "a streaming client hung"
        return self.outcomes


def test_a_killed_router_leaves_the_other_serving_and_the_nodes_release_its_requests(routers, single_node):
    """Load through both routers; router B is SIGKILLed while its streams are mid-generation.
    Router A's requests all succeed, before and after; the nodes abort B's requests when its
    streams drop, and once B's leases and fences ran out (seconds here) every node is back at
    baseline: nothing of the dead router's requests stays held."""
    fleet, b, _ = routers
    decode_url = next(n["url"] for n in fleet.cluster()["nodes"] if n["role"] == "decode")
    aborted_before = fleet.info(decode_url)["snapshot"]["outcomes"].get("aborted", 0)
    load_a = Load(fleet, limit=30, max_tokens=6)
    load_b = StreamLoad(b, limit=10, max_tokens=200)
    try:
        assert load_b.streaming.wait(120), "no stream through router B got a token"
        b_before_kill = list(load_b.outcomes)
        b.proc.kill()                          # SIGKILL: no goodbye to the nodes, its streams just drop
        b.proc.wait(30)
        outcomes_b = load_b.stop()
        done_at_kill = len(load_a.outcomes)
        # router A keeps serving: a bounded number of its requests complete after the kill
        _wait(lambda: len(load_a.outcomes) >= done_at_kill + 6 or not any(t.is_alive() for t in load_a._threads),
              120, "router A's requests after the kill")
    finally:
        outcomes_b = load_b.stop()
        outcomes_a = load_a.stop()
    print("router A:", {o: outcomes_a.count(o) for o in set(outcomes_a)},
          "router B:", {o: outcomes_b.count(o) for o in set(outcomes_b)})
    assert outcomes_a and all(o == "ok" for o in outcomes_a), outcomes_a
    assert len(outcomes_a) >= done_at_kill + 6, outcomes_a
    assert all(o == "ok" for o in b_before_kill), b_before_kill        # B served until it was killed ...
    assert any(o.startswith("cut:") for o in outcomes_b), outcomes_b   # ... and died with streams mid-generation
    # the nodes held nothing of B's requests once its streams dropped and its leases and fences ran out ...
    snaps = _settle(fleet, timeout=90)
    # ... and decode ended each stream cut mid-generation as aborted (the router hung up), not by finishing it
    aborted = snaps[decode_url]["outcomes"].get("aborted", 0) - aborted_before
    assert aborted >= sum(o.startswith("cut:") for o in outcomes_b), (aborted, outcomes_b)
    _every_node_ready(fleet)
    for i, p in enumerate(PROMPTS[:3]):   # router A still gives the single node's output
        assert _complete(fleet, KEYS[i % 3], p) == single_node[p]
    _settle(fleet)


def test_a_router_stopped_with_sigterm_finishes_its_streams_and_the_other_serves(routers, single_node):
    """SIGTERM to router C while it streams: that stream still gets every token, C exits and
    takes no new connection, router A serves throughout, and the nodes hold nothing after."""
    fleet, _, c = routers
    client = c.client(KEYS[1])
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[4], max_tokens=64,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    c.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)                  # the stream goes on to its end
    finish = [ch.choices[0].finish_reason for ch in [first, *rest] if ch.choices and ch.choices[0].finish_reason]
    usage = [ch.usage for ch in rest if ch.usage is not None]
    assert finish == ["length"] and usage and usage[-1].completion_tokens == 64, (finish, usage)
    c.proc.wait(60)                      # then C exits (uvicorn re-raises the signal: rc -15 or 0)
    with pytest.raises(openai.APIConnectionError):
        c.client(KEYS[1]).models.list()
    for i, p in enumerate(PROMPTS[:3]):   # router A serves the single node's output
        assert _complete(fleet, KEYS[i % 3], p) == single_node[p]
    _settle(fleet)
