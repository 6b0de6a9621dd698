"""`kvfence soak`: mixed load with faults against a PD cluster for a chosen duration.

Starts a cluster as `kvfence launch-pd` does (with fault control when --faults is on),
then keeps `--concurrency` clients busy with a mix of requests: short and long prompts,
over-length ones, streaming clients that hang up midway. With --faults, every
`--fault-every` seconds one fault point that the cluster must survive is switched on at
one node for a few seconds (a corrupted transfer, lost/late/duplicated completion
notices, a slow handoff). Every `--sample-every` seconds it records each process's RSS,
the nodes' pool and transfer-buffer occupancy and the request outcomes so far.

At the end the load stops, the cluster gets time for fences to lift, and the summary
says: requests by outcome, error rate outside injected faults, latency percentiles, RSS
at start/end/max per process, and whether every page and row came back. Exit code 1 if
anything leaked, a request hung, or a request failed with no fault to blame.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvfence.arg_types import at_least_one, folder, output_file, seconds
from kvfence.bench.http_load import make_prompt
from kvfence.bench.pd import Procs, free_ports, pd_commands
from kvfence.bench.stats import percentiles
from kvfence.pd.messages import NodeInfo
from kvfence.pd.tls import FOLLOW_PROXY_ENV

# (node, fault) pairs a healthy cluster must ride out: each fails or slows a request, never leaks
SURVIVABLE = [("prefill", "corrupt_staged_page"), ("decode", "duplicate_transfer_completion"),
              ("decode", "delay_transfer_completion:0.5"), ("decode", "drop_transfer_completion"),
              ("router", "delay_handoff:1")]
# codes a request may end with while a fault is on (the fault's own, visible, failure)
FAULT_CODES = {"kv_verification_failed", "kv_transfer_timeout", "lease_expired", "aborted_by_peer"}


def _outcome(status: int, body: bytes) -> str:
    """A refused or failed answer as "status:code" (200 and 400 as their status alone)."""
    if status in (200, 400):
        return str(status)
    try:
        code = json.loads(body).get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return f"{status}:{code}"


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


@dataclass
class SoakSummary:
    seconds: float
    requests: int
    outcomes: dict
    unexplained_errors: int
    hung: int
    latency_ms: dict
    rss_mib: dict                  # process -> {start, end, max}
    faults_injected: dict
    leaked: dict                   # node -> what was not back at the end (empty: nothing)
    samples: list = field(default_factory=list)
    interrupted: bool = False      # Ctrl-C: what ran until then, the end-of-run leak check not made

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.leaked and self.hung == 0 and self.unexplained_errors == 0

    def text(self) -> str:
        verdict = "INTERRUPTED (no verdict)" if self.interrupted else "PASS" if self.ok else "FAIL"
        lines = [f"soak: {self.seconds / 60:.1f} min, {self.requests} requests, {verdict}",
                 "  outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())),
                 f"  errors with no fault to blame: {self.unexplained_errors}; hung: {self.hung}",
                 f"  latency ms: {self.latency_ms}",
                 "  faults injected: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.faults_injected.items()))
                                          or "none")]
        for name, r in self.rss_mib.items():
            lines.append(f"  RSS {name}: start {r['start']:.0f} MiB, end {r['end']:.0f} MiB, max {r['max']:.0f} MiB")
        lines.append("  leaked at the end: " + ("not checked (interrupted)" if self.interrupted
                                                  else json.dumps(self.leaked) if self.leaked else "nothing"))
        return "\n".join(lines)


class Soak:
    def __init__(self, a, urls: dict, pids: dict, usable: int, internal_headers: dict[str, str]):
        self.a = a
        self.urls = urls
        self.internal_headers = internal_headers   # the nodes' internal routes need the credential
        self.pids = pids
        self.usable = usable
        self.rng = random.Random(a.seed)
        self.outcomes: Counter[str] = Counter()
        self.unexplained = 0
        self.hung = 0
        self.latencies: list[float] = []
        self.fault_on: str | None = None
        self.fault_windows: list[list] = []   # [start, end or None]: requests overlapping one may fail
        self.faults: Counter[str] = Counter()
        self.samples: list[dict] = []
        self.rss = {n: [] for n in pids}
        self.t0 = time.monotonic()

    def _request(self) -> tuple[dict, bool, bool]:
        r = self.rng.random()
        if r < 0.1:
            words = int(self.usable * 1.5)        # over-length: must be a 400
        elif r < 0.3:
            words = self.rng.randint(200, max(201, self.usable // 3))
        else:
            words = self.rng.randint(3, 60)
        stream = self.rng.random() < 0.4
        hang_up = stream and self.rng.random() < 0.3
        body = {"model": self.a.model_name, "prompt": make_prompt(self.rng.randrange(1 << 30), words),
                "max_tokens": self.rng.randint(1, 24), "temperature": 0.0, "stream": stream}
        return body, stream, hang_up

    async def client(self, http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            body, stream, hang_up = self._request()
            fault = self.fault_on
            t0 = time.monotonic()
            try:
                if stream:
                    async with http.stream("POST", self.urls["router"] + "/v1/completions", json=body) as r:
                        if r.status_code != 200:   # refused before it began (a failed handoff is,
                            # a stream's too): its code, as an unstreamed answer's
                            outcome = _outcome(r.status_code, await r.aread())
                        else:
                            outcome, n = "200", 0
                            async for text in r.aiter_lines():
                                if text.startswith("data: {") and '"error"' in text:
                                    outcome = "stream_error:" + json.loads(text[6:])["error"].get("code", "?")
                                n += 1
                                if hang_up and n >= 2:
                                    outcome = "hung_up"
                                    break
                else:
                    r = await http.post(self.urls["router"] + "/v1/completions", json=body)
                    outcome = _outcome(r.status_code, r.content)
            except httpx.TimeoutException:
                outcome, self.hung = "timeout", self.hung + 1
            except httpx.HTTPError as e:
                outcome = f"transport:{type(e).__name__}"
            t1 = time.monotonic()
            self.latencies.append(t1 - t0)
            self.outcomes[outcome] += 1
            if outcome not in ("200", "400", "hung_up", "timeout"):
                blamed = fault or any(s <= t1 and (e is None or e >= t0) for s, e in self.fault_windows)
                if not blamed or outcome.split(":")[-1] not in FAULT_CODES:
                    self.unexplained += 1

    async def chaos(self, http: httpx.AsyncClient, until: float) -> None:
        if not self.a.faults:
            return
        while time.monotonic() < until:
            await asyncio.sleep(self.a.fault_every)
            node, spec = self.rng.choice(SURVIVABLE)
            await http.post(self.urls[node] + "/internal/test/faults", json={"spec": spec},
                            headers=self.internal_headers)
            self.fault_on = spec
            self.faults[spec] += 1
            window = [time.monotonic(), None]
            self.fault_windows.append(window)
            await asyncio.sleep(self.a.fault_length)
            await http.post(self.urls[node] + "/internal/test/faults", json={"spec": ""},
                            headers=self.internal_headers)
            self.fault_on = None
            # a request may still fail from it while its pull or lease runs out
            window[1] = time.monotonic() + self.a.lease + self.a.max_pull + self.a.clock_skew

    async def node_info(self, http: httpx.AsyncClient, role: str) -> NodeInfo:
        r = await http.get(self.urls[role] + "/internal/info", headers=self.internal_headers)
        return NodeInfo.from_json(r.content)

    async def sampler(self, http: httpx.AsyncClient, until: float) -> None:
        t0 = time.monotonic()
        while True:
            s = {"t": round(time.monotonic() - t0, 1),
                 "rss_mib": {n: round(_rss_mib(p), 1) for n, p in self.pids.items()},
                 "requests": sum(self.outcomes.values()), "outcomes": dict(self.outcomes)}
            for role in ("prefill", "decode"):
                try:
                    snap = (await self.node_info(http, role)).snapshot
                    s[role] = {"pages_owned": snap["pages_owned"], "pages_free": snap["pages_free"],
                               "quarantined": snap["pages_quarantined"],
                               "buffer_free": snap["pd"]["buffer_free"], "buffer_fenced": snap["pd"]["buffer_fenced"]}
                except (httpx.HTTPError, KeyError, ValueError):
                    s[role] = None
            for n, v in s["rss_mib"].items():
                self.rss[n].append(v)
            self.samples.append(s)
            if self.a.verbose_samples:
                print(json.dumps(s), flush=True)
            if time.monotonic() >= until:
                return
            await asyncio.sleep(min(self.a.sample_every, max(0.0, until - time.monotonic())))

    async def leaks(self, http: httpx.AsyncClient, settle_s: float) -> dict:
        end = time.monotonic() + settle_s
        while True:
            leaked = {}
            for role in ("prefill", "decode"):
                snap = (await self.node_info(http, role)).snapshot
                pd = snap["pd"]
                bad = {k: v for k, v in {"pages_owned": snap["pages_owned"], "running": snap["running"],
                                         "waiting": snap["waiting"],
                                         "buffer_rows_not_free": pd["buffer_rows"] - pd["buffer_free"]}.items() if v}
                if bad:
                    leaked[role] = bad
            if not leaked or time.monotonic() > end:
                return leaked
            await asyncio.sleep(1.0)

    async def run(self) -> SoakSummary:
        self.t0 = time.monotonic()
        until = self.t0 + self.a.duration
        timeout = httpx.Timeout(self.a.request_timeout, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=200),
                                     trust_env=FOLLOW_PROXY_ENV) as http:
            tasks = [self.client(http, until) for _ in range(self.a.concurrency)]
            await asyncio.gather(self.chaos(http, until), self.sampler(http, until), *tasks)
            # every fence lifts within lease + max pull + skew of its lease's end
            leaked = await self.leaks(http, self.a.settle)
        return self.summary(leaked)

    def summary(self, leaked: dict, interrupted: bool = False) -> SoakSummary:
        """What was seen so far (Ctrl-C: an hour's soak still reports its outcomes and samples)."""
        rss = {n: {"start": v[0], "end": v[-1], "max": max(v)} for n, v in self.rss.items() if v}
        latency = {k: round(v, 1) for k, v in percentiles(self.latencies).items()}
        return SoakSummary(time.monotonic() - self.t0, sum(self.outcomes.values()), dict(self.outcomes),
                           self.unexplained, self.hung, latency, rss, dict(self.faults), leaked, self.samples,
                           interrupted)


def parse_duration(text: str) -> float:
    text = str(text).strip().lower()
    for suffix, mult in (("h", 3600), ("m", 60), ("s", 1)):
        if text.endswith(suffix):
            return float(text[:-1]) * mult
    return float(text)


def _duration_arg(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 90s, 30m, 1h)") from None
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be longer than 0, got {text!r}")
    return v


def main(a) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request drowned the samples
    logdir = Path(a.logdir or tempfile.mkdtemp(prefix="kvfence-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    port = free_ports(3)
    procs = Procs(logdir)
    if a.faults:
        procs.env["KVFENCE_TEST_FAULT_CONTROL"] = "1"
    cmds = pd_commands(a, port, procs.secret_file)
    for role, cmd in cmds.items():
        procs.start(role, cmd)
    urls = {"router": f"http://127.0.0.1:{port}", "prefill": f"http://127.0.0.1:{port + 1}",
            "decode": f"http://127.0.0.1:{port + 2}"}
    try:
        procs.wait(lambda: httpx.get(urls["router"] + "/health", timeout=2).status_code == 200, "the cluster", 300)
        usable = httpx.get(urls["router"] + "/v1/kvfence/cluster").json()["check"]["usable_context"]
        a.model_name = httpx.get(urls["router"] + "/v1/models").json()["data"][0]["id"]
        print(f"soak: cluster up (usable context {usable}), logs in {logdir}; {a.duration:.0f} s of load, "
              f"{a.concurrency} clients, faults {'on' if a.faults else 'off'}", flush=True)
        soak = Soak(a, urls, {r: p.pid for r, p in procs.procs.items()}, usable, procs.internal_headers)
        try:
            summary = asyncio.run(soak.run())
        except KeyboardInterrupt:
            summary = soak.summary({}, interrupted=True)
    finally:
        procs.stop()
    print(summary.text(), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(summary), indent=2))
    return 130 if summary.interrupted else 0 if summary.ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", default="30m", type=_duration_arg, help="how long to load the cluster: 90s, 30m, 1h")
    p.add_argument("--concurrency", type=at_least_one, default=8)
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                   help="switch survivable fault points on and off while loading")
    p.add_argument("--fault-every", type=seconds, default=20.0, help="seconds between faults")
    p.add_argument("--fault-length", type=seconds, default=4.0, help="seconds a fault stays on")
    p.add_argument("--sample-every", type=seconds, default=10.0)
    p.add_argument("--request-timeout", type=seconds, default=120.0, help="a request slower than this counts as hung")
    p.add_argument("--settle", type=seconds, default=60.0, help="seconds allowed at the end for fences to lift")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, type=output_file, help="write the summary (with every sample) to this file")
    p.add_argument("--logdir", default=None, type=folder, help="process logs (default: a temporary folder)")
    p.add_argument("--verbose-samples", action="store_true", help="print each sample as a JSON line")
