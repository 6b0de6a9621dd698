"""A real PD cluster for tests: prefill, decode and router as separate `kvfence serve`
processes talking HTTP and moving KV with the Mooncake transfer engine.

Each process is started with KVFENCE_TEST_FAULT_CONTROL=1 so a test can switch fault
points on a running node (POST /internal/test/faults); `prefix` runs a command in front
of a node (e.g. `ip netns exec ns1`) so the same harness runs nodes in other hosts, where a
node may listen on one address (`binds`), be reached at another (`hosts`) and advertise a
third to its transfer peer (`transfer_hosts`).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvfence.pd.seal import SECRET_ENV, SECRET_FILE_ENV
from kvfence.pd.wire import cluster_headers
from kvfence.procs import free_ports, stop_processes

ROOT = Path(__file__).resolve().parents[2]
# with a tenants file the router shows its nodes only to the [metrics] or [operator] key; a
# router without one (one tenant) shows them to anyone and ignores the header
SCRAPE_KEY = "sk-pd-scraper-0001"
SCRAPE = {"Authorization": f"Bearer {SCRAPE_KEY}"}


def wait_until(pred, timeout: float, what: str = "the condition", interval: float = 0.1):
    """pred()'s first true value within `timeout` seconds, else AssertionError naming `what`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    return free_ports(1)


# The default dtype: a step ~11 ms here against float32's ~60 ms; 32 MiB of bf16 pages is the
# pool 64 MiB of float32 gave. Single-node references use the same (tests/pd/conftest.py make_llm).
NODE_ARGS = ["--dtype", "bfloat16", "--kv-cache-memory", "32MiB", "--max-model-len", "1024", "--threads", "1",
             "--lease", "4", "--transfer-timeout", "2", "--max-pull", "3", "--clock-skew", "0.5",
             "--max-num-batched-tokens", "128"]  # prompts take several steps: a test can act mid-prefill


class Cluster:
    def __init__(self, workdir: Path, node_args=None, router_args=None, hosts=None, prefixes=None, env=None,
                 binds=None, transfer_hosts=None, pki: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.node_args = list(NODE_ARGS if node_args is None else node_args)
        self.router_args = list(router_args or [])
        # hosts: where the router and the test reach each process; binds: the address it
        # listens on; transfer_hosts: what a node's transfer engine advertises (both default to hosts)
        self.hosts = {"prefill": "127.0.0.1", "decode": "127.0.0.1", "router": "127.0.0.1", **(hosts or {})}
        self.binds = {**self.hosts, **(binds or {})}
        self.transfer_hosts = {**self.hosts, **(transfer_hosts or {})}
        self.prefixes = prefixes or {}
        # pki (tests/pd/certs.py): nodes serve HTTPS and require the router's client certificate
        self.pki = pki
        self.ports = {r: free_port() for r in ("prefill", "decode", "router")}
        self.procs: dict[str, subprocess.Popen] = {}
        # this cluster's secret, in a file named by the environment, never on a command line; the
        # nodes also accept the secret of a second file, the same one until a test rotates the
        # cluster's secret by editing both and sending SIGHUP (test_cluster.py)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file, self.accept_file = str(self.workdir / "cluster.secret"), str(self.workdir / "accept.secret")
        self.use_secret(secrets.token_hex(32))
        self.write_secrets(self.secret, self.secret)
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "KVFENCE_TEST_FAULT_CONTROL": "1",
                    "PYTHONUNBUFFERED": "1", SECRET_FILE_ENV: self.secret_file,
                    "XDG_STATE_HOME": str(self.workdir),   # each process's incident log: see incident_log()
                    **(env or {})}
        self.env.pop("KVFENCE_TEST_FAULTS", None)
        self.env.pop(SECRET_ENV, None)

    def use_secret(self, text: str) -> None:
        """The secret this harness calls the nodes' /internal/* routes with."""
        self.secret = text
        self.headers = cluster_headers(text.encode())   # the credential for /internal/*

    def write_secrets(self, own: str, accepted: str) -> None:
        """What the processes read from their secret files at start or on SIGHUP."""
        for path, text in ((self.secret_file, own), (self.accept_file, accepted)):
            with open(path, "w") as f:
                f.write(text + "\n")
            os.chmod(path, 0o600)

    def incident_log(self, role: str) -> list[dict]:
        """The records in `role`'s incident log (kvfence/incidents.py default path)."""
        path = self.workdir / "kvfence" / f"incidents-{role}-{self.ports[role]}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def url(self, role: str) -> str:
        scheme = "https" if self.pki is not None and role != "router" else "http"
        return f"{scheme}://{self.hosts[role]}:{self.ports[role]}"

    def http_kwargs(self, role: str) -> dict:
        """What an httpx call to `role` needs besides the credential (CA and client cert under TLS)."""
        if self.pki is None or role == "router":
            return {}
        ctx = ssl.create_default_context(cafile=self.pki["ca"])
        ctx.load_cert_chain(self.pki["client_cert"], self.pki["client_key"])
        return {"verify": ctx}

    def _tls_args(self, role: str) -> list[str]:
        if self.pki is None:
            return []
        k = self.pki
        if role == "router":
            return ["--tls-ca", k["ca"], "--tls-client-cert", k["client_cert"], "--tls-client-key", k["client_key"]]
        return ["--tls-cert", k["server_cert"], "--tls-key", k["server_key"], "--tls-ca", k["ca"]]

    def command(self, role: str, extra=()) -> list[str]:
        base = [sys.executable, "-m", "kvfence.cli", "serve", "--role", role, "--host", self.binds[role],
                "--port", str(self.ports[role])]
        if role == "router":
            return base + ["--prefill-url", self.url("prefill"), "--decode-url", self.url("decode"),
                           "--node-stall", "5"] + self.router_args + self._tls_args(role) + list(extra)
        return (list(self.prefixes.get(role, [])) + base + ["--transfer-host", self.transfer_hosts[role],
                                                            "--accept-cluster-secret-file", self.accept_file]
                + self.node_args + self._tls_args(role) + list(extra))

    def start(self, role: str, extra=()) -> subprocess.Popen:
        log = open(self.workdir / f"{role}.log", "ab")
        p = subprocess.Popen(self.command(role, extra), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[role] = p
        return p

    def start_all(self, timeout: float = 240) -> Cluster:
        try:
            for role in ("prefill", "decode", "router"):
                self.start(role)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise
        return self

    def log(self, role: str) -> str:
        try:
            return (self.workdir / f"{role}.log").read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for role, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{role} exited with {p.returncode}:\n{self.log(role)[-3000:]}")
            try:  # ready, and the router has checked the nodes that run now (not ones that died)
                r = httpx.get(self.url("router") + "/v1/kvfence/cluster", headers=SCRAPE, timeout=2)
                if r.status_code == 200 and r.json().get("ready"):
                    seen = {n["role"]: n["boot_id"] for n in r.json()["nodes"] if n["state"] == "ready"}
                    if all(self.info(role)["pd"]["boot_id"] == seen[role] for role in ("prefill", "decode")):
                        return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError("the PD cluster did not become ready:\n" +
                           "\n".join(f"--- {r}\n{self.log(r)[-2000:]}" for r in self.procs))

    def info(self, role: str) -> dict:
        return httpx.get(self.url(role) + "/internal/info", headers=self.headers, timeout=10,
                         **self.http_kwargs(role)).json()

    def routed_node(self, role: str) -> dict:
        """The router's /v1/kvfence/cluster entry for this cluster's node of `role`."""
        nodes = httpx.get(self.url("router") + "/v1/kvfence/cluster", headers=SCRAPE, timeout=10).json()["nodes"]
        return next(n for n in nodes if n["url"] == self.url(role))

    def pd(self, role: str) -> dict:
        return self.info(role)["snapshot"]["pd"]

    def set_faults(self, role: str, spec: str = "") -> None:
        r = httpx.post(self.url(role) + "/internal/test/faults", json={"spec": spec}, headers=self.headers,
                       timeout=10, **self.http_kwargs(role))
        r.raise_for_status()

    def clear_faults(self) -> None:
        for role in ("prefill", "decode", "router"):
            if role in self.procs and self.procs[role].poll() is None:
                try:
                    self.set_faults(role, "")
                except httpx.HTTPError:
                    pass

    def signal(self, role: str, sig: int) -> None:
        self.procs[role].send_signal(sig)

    def kill(self, role: str) -> None:
        p = self.procs[role]
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def wait_quiet(self, timeout: float = 30.0) -> dict:
        """Wait until neither node owns a pool page or a transfer-buffer row, nothing is held,
        fenced or in flight; returns the last snapshots."""
        end = time.monotonic() + timeout
        last = {}
        while time.monotonic() < end:
            last = {r: self.info(r)["snapshot"] for r in ("prefill", "decode")}
            if all(s["pages_owned"] == 0 and s["running"] == 0 and s["waiting"] == 0
                   and s["pd"]["buffer_free"] == s["pd"]["buffer_rows"] for s in last.values()):
                return last
            time.sleep(0.3)
        raise AssertionError(f"the cluster did not settle: {last}")

    def stop(self) -> None:
        stop_processes(self.procs.values(), grace_s=20, wake=True)


class MultiCluster(Cluster):
    """A cluster of any number of nodes: `nodes` maps each node's name to its role, e.g.
    {"prefill": "prefill", "prefill-2": "prefill", "decode": "decode"}. hosts, binds,
    transfer_hosts and prefixes are keyed by those names (a name not given one: 127.0.0.1,
    no prefix); the router gets every node of each role. Methods that take a role in Cluster
    take a node name here."""

    def __init__(self, workdir: Path, nodes: dict[str, str], **kw):
        super().__init__(workdir, **kw)
        self.nodes = dict(nodes)
        for name in self.nodes:
            self.hosts.setdefault(name, "127.0.0.1")
            self.binds.setdefault(name, self.hosts[name])
            self.transfer_hosts.setdefault(name, self.hosts[name])
            if name not in self.ports:
                self.ports[name] = free_port()

    def names(self, role: str) -> list[str]:
        return [n for n, r in self.nodes.items() if r == role]

    def command(self, role: str, extra=()) -> list[str]:
        name = role
        if name == "router":
            urls = {r: ",".join(self.url(n) for n in self.names(r)) for r in ("prefill", "decode")}
            return [sys.executable, "-m", "kvfence.cli", "serve", "--role", "router", "--host", self.binds[name],
                    "--port", str(self.ports[name]), "--prefill-url", urls["prefill"], "--decode-url", urls["decode"],
                    "--node-stall", "5"] + self.router_args + self._tls_args(name) + list(extra)
        return (list(self.prefixes.get(name, [])) +
                [sys.executable, "-m", "kvfence.cli", "serve", "--role", self.nodes[name], "--host", self.binds[name],
                 "--port", str(self.ports[name]), "--transfer-host", self.transfer_hosts[name]]
                + self.node_args + self._tls_args(name) + list(extra))

    def start_all(self, timeout: float = 240) -> MultiCluster:
        try:
            for name in [*self.nodes, "router"]:
                self.start(name)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log(name)[-3000:]}")
            try:  # ready, and the router has checked every node as it runs now
                r = httpx.get(self.url("router") + "/v1/kvfence/cluster", headers=SCRAPE, timeout=2)
                if r.status_code == 200 and r.json().get("ready"):
                    seen = {n["url"]: n["boot_id"] for n in r.json()["nodes"] if n["state"] == "ready"}
                    if all(self.info(n)["pd"]["boot_id"] == seen.get(self.url(n)) for n in self.nodes):
                        return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError("the PD cluster did not become ready:\n" +
                           "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs))

    def routed_nodes(self) -> list[dict]:
        """The router's /v1/kvfence/cluster entries, one per node (state, routed, in_flight, ...)."""
        return httpx.get(self.url("router") + "/v1/kvfence/cluster", headers=SCRAPE, timeout=10).json()["nodes"]

    def clear_faults(self) -> None:
        for name in [*self.nodes, "router"]:
            if name in self.procs and self.procs[name].poll() is None:
                try:
                    self.set_faults(name, "")
                except httpx.HTTPError:
                    pass

    def wait_quiet(self, timeout: float = 30.0) -> dict:
        end = time.monotonic() + timeout
        last = {}
        while time.monotonic() < end:
            last = {n: self.info(n)["snapshot"] for n in self.nodes}
            if all(s["pages_owned"] == 0 and s["running"] == 0 and s["waiting"] == 0
                   and s["pd"]["buffer_free"] == s["pd"]["buffer_rows"] for s in last.values()):
                return last
            time.sleep(0.3)
        raise AssertionError(f"the cluster did not settle: {last}")
