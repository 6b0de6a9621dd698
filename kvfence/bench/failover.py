"""`kvfence bench --failover`: what one node's death under load costs the clients of a PD fleet.

A fleet as `kvfence launch-pd --prefill P --decode D` starts it (2 + 2 by default), four
tenants with their own system prompts, --num-requests streamed completions in all with C in
flight (greedy, 16 tokens each). Once a quarter of them are answered, one node of the --kill
role is SIGKILLed (no drain, no restart: a crash). Reported: how many requests were answered
and how the others failed (HTTP status and code, or an error event mid-stream), the router's
retries by stage (a handoff retry is a whole request done again on other nodes,
pd/router.py may_redo), time to first token before the kill, of the requests in flight when it
came, and after; the most transfer rows the surviving nodes held and fenced (a dead decode
node may still have been reading: prefill fences its rows until no read can run, I6), and how
long the survivors took to hold nothing again, with their isolation violations (0 expected).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfence.bench.fleet import SCRAPE, TENANTS, _tenants_file
from kvfence.bench.http_load import make_prompt, sse_messages
from kvfence.bench.pd import HOST, Procs, pd_commands
from kvfence.bench.stats import percentiles
from kvfence.pd.messages import NodeInfo
from kvfence.pd.settings import PDSettings
from kvfence.pd.tls import FOLLOW_PROXY_ENV
from kvfence.procs import free_ports

MAX_TOKENS, QUESTION_WORDS = 16, 12
KILL_AFTER = 0.25      # the share of requests answered before the kill
SETTLE_MARGIN_S = 20.0   # beyond the longest fence (lease + max pull + clock skew after a hold, I6)


@dataclass
class Outcome:
    started: float                 # perf_counter at its send
    ttft: float | None = None      # seconds to its first text
    error: str | None = None       # None: answered whole


@dataclass
class Watch:
    """The surviving nodes' transfer rows, sampled while the load runs."""
    held_max: int = 0
    fenced_max: int = 0
    samples: int = 0
    failures: list[str] = field(default_factory=list)


async def _one(http: httpx.AsyncClient, url: str, key: str, model: str, prompt: str) -> Outcome:
    out = Outcome(time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                err = json.loads(await r.aread() or b"{}").get("error") or {}
                out.error = f"HTTP {r.status_code} {err.get('code')}"
                return out
            async for msg in sse_messages(r):
                if "error" in msg:   # after the 200: the stream ends with an error event
                    out.error = f"mid-stream {msg['error'].get('code')}"
                    return out
                if out.ttft is None and msg.get("choices") and msg["choices"][0].get("text"):
                    out.ttft = time.perf_counter() - out.started
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}"
    return out


async def _watch(nodes: list[str], headers: dict[str, str], watch: Watch, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5, trust_env=FOLLOW_PROXY_ENV) as http:
        while not stop.is_set():
            for url in nodes:
                try:
                    pd = NodeInfo.from_json((await http.get(url + "/internal/info", headers=headers)).content
                                            ).snapshot.get("pd") or {}
                except (httpx.HTTPError, ValueError):
                    continue   # the dead one, or a node busy past 5 s
                fenced = int(pd.get("buffer_fenced", 0))
                watch.fenced_max = max(watch.fenced_max, fenced)
                watch.held_max = max(watch.held_max, int(pd.get("buffer_rows", 0)) - int(pd.get("buffer_free", 0))
                                     - fenced)
                watch.samples += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def _load(a, url: str, keys: list[str], model: str, kill, survivors: list[str], headers: dict[str, str]
                ) -> tuple[list[Outcome], float | None, Watch]:
    systems = [make_prompt(0, a.prompt_tokens, seed=100 + t) for t in range(len(keys))]
    jobs = [(keys[i % len(keys)], f"{systems[i % len(keys)]}\nQuestion {i}: "
             f"{make_prompt(i, QUESTION_WORDS, seed=200 + i)}") for i in range(a.num_requests)]
    random.Random(getattr(a, "seed", None) or 0).shuffle(jobs)
    sem = asyncio.Semaphore(a.concurrency)
    outcomes: list[Outcome] = []
    killed_at: list[float] = []
    watch, stop = Watch(), asyncio.Event()

    async def run(key: str, prompt: str) -> None:
        async with sem:
            outcomes.append(await _one(http, url, key, model, prompt))
        if not killed_at and len(outcomes) >= a.num_requests * KILL_AFTER:
            killed_at.append(time.perf_counter())
            kill()
    watcher = asyncio.create_task(_watch(survivors, headers, watch, stop))
    async with httpx.AsyncClient(timeout=a.timeout) as http:
        await asyncio.gather(*(run(k, p) for k, p in jobs))
    stop.set()
    await watcher
    return outcomes, (killed_at[0] if killed_at else None), watch


def _settle(survivors: list[str], headers: dict[str, str], limit_s: float) -> tuple[float | None, int, dict]:
    """(seconds until every survivor held nothing, or None; their isolation violations; the
    last snapshots)."""
    t0, last = time.monotonic(), {}
    while True:
        for url in survivors:
            r = httpx.get(url + "/internal/info", headers=headers, timeout=10, trust_env=FOLLOW_PROXY_ENV)
            last[url] = NodeInfo.from_json(r.content).snapshot
        violations = sum(int(s.get("violations") or 0) for s in last.values())
        if all(s["pages_owned"] == 0 and s["running"] == 0 and s["pd"]["buffer_free"] == s["pd"]["buffer_rows"]
               for s in last.values()):
            return round(time.monotonic() - t0, 1), violations, last
        if time.monotonic() - t0 > limit_s:
            return None, violations, last
        time.sleep(0.5)


def _retries(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics", headers=SCRAPE, timeout=10).text
    return {s.labels["stage"]: int(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvfence_pd_request_retries_total"}


def summarize(outcomes: list[Outcome], killed_at: float | None) -> dict:
    """Answers and failures, and TTFT before the kill, of those in flight at it, and after."""
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    cut = killed_at if killed_at is not None else float("inf")
    answered = [o for o in outcomes if o.error is None and o.ttft is not None]
    phases = {"before": [o.ttft for o in answered if o.started + o.ttft < cut],
              "in_flight_at_kill": [o.ttft for o in answered if o.started < cut <= o.started + o.ttft],
              "after": [o.ttft for o in answered if o.started >= cut]}
    return {"requests": len(outcomes), "answered": len(answered), "errors": errors,
            "ttft_ms": {k: {**percentiles(v), "n": len(v)} for k, v in phases.items()}}


def main(a) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    a.kv_cache_memory = a.kv_cache_memory or "512MiB"
    a.prefill, a.decode = a.prefill or 2, a.decode or 2
    a.num_requests = a.num_requests or 64
    a.concurrency = a.concurrency or 8
    a.prompt_tokens = a.prompt_tokens or 160
    a.timeout = a.timeout or 300.0
    role = a.kill
    # rows a dead decode node may still have been reading stay fenced this long after their hold
    # the nodes' own defaults (this bench passes none of the PD flags)
    fence_s = PDSettings.lease_s + PDSettings.max_pull_s + PDSettings.clock_skew_s
    if getattr(a, role) < 2:
        print(f"error: --failover --kill {role} needs at least two {role} nodes (--{role} 2): with one, every "
              "request after the kill fails by design", flush=True)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-failover-") as tmp:
        logdir = Path(tmp)
        port = free_ports(a.prefill + a.decode + 1)
        procs = Procs(logdir)
        keys = _tenants_file(logdir / "tenants.toml", TENANTS)
        cmds = pd_commands(a, port, procs.secret_file)
        cmds["router"] += ["--tenants", str(logdir / "tenants.toml")]
        url = f"http://{HOST}:{port}"
        try:
            for name, cmd in cmds.items():
                procs.start(name, cmd)
            print(f"fleet of {a.prefill} prefill + {a.decode} decode nodes starting ...", flush=True)
            procs.wait(lambda: (s := httpx.get(url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=2).json())[
                "ready"] and all(n["state"] == "ready" for n in s["nodes"]), "the fleet", 600)
            nodes = httpx.get(url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=10).json()["nodes"]
            victim = next(n["url"] for n in nodes if n["role"] == role)
            name = next(k for k, cmd in cmds.items() if k != "router" and victim.endswith(":" + cmd[cmd.index(
                "--port") + 1]))
            survivors = [n["url"] for n in nodes if n["url"] != victim]
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {keys[0]}"},
                              timeout=30).json()["data"][0]["id"]
            before = _retries(url)
            print(f"{a.num_requests} requests, {a.concurrency} in flight; {role} node {victim} is killed after "
                  f"{int(a.num_requests * KILL_AFTER)} answers ...", flush=True)
            t0 = time.perf_counter()
            outcomes, killed_at, watch = asyncio.run(_load(a, url, keys, model, procs.procs[name].kill, survivors,
                                                           procs.internal_headers))
            wall = time.perf_counter() - t0
            after = _retries(url)
            settled_s, violations, last = _settle(survivors, procs.internal_headers, fence_s + SETTLE_MARGIN_S)
        finally:
            procs.stop()
    result = {**summarize(outcomes, killed_at), "killed": {"role": role, "node": victim},
              "retries": {k: after.get(k, 0) - before.get(k, 0) for k in after},
              "transfer_rows": {"held_max": watch.held_max, "fenced_max": watch.fenced_max, "samples": watch.samples},
              "survivors_settled_s": settled_s, "fence_s": fence_s, "violations": violations, "wall_s": round(wall, 1),
              "fleet": {"prefill": a.prefill, "decode": a.decode}, "concurrency": a.concurrency}
    _print(result)
    if settled_s is None:
        print(f"the survivors still held something after {fence_s + SETTLE_MARGIN_S:.0f} s: "
              + json.dumps({u: {k: s.get(k) for k in ("pages_owned", "running", "pd")} for u, s in last.items()}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    ok = result["answered"] == result["requests"] and settled_s is not None and violations == 0
    return 0 if ok else 1


def _print(r: dict) -> None:
    print(f"\nkilled: {r['killed']['role']} node {r['killed']['node']} (SIGKILL, not restarted)")
    print(f"answered {r['answered']}/{r['requests']}; failed: "
          + (", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items())) or "none"))
    print("router retries: " + ", ".join(f"{k} {v}" for k, v in sorted(r["retries"].items()))
          + " (handoff: the whole request again on other nodes)")
    print(f"{'TTFT':<20} {'n':>4} {'p50':>9} {'p90':>9} {'max':>9}")
    for phase, t in r["ttft_ms"].items():
        if t["n"]:
            print(f"{phase:<20} {t['n']:>4} {t['p50']:>7.0f}ms {t['p90']:>7.0f}ms {t['p99']:>7.0f}ms")
    rows = r["transfer_rows"]
    print(f"surviving nodes' transfer rows: held at most {rows['held_max']}, fenced at most {rows['fenced_max']} "
          f"({rows['samples']} samples; a fence lasts up to {r['fence_s']:.0f} s after its hold: --lease + "
          "--max-pull + --clock-skew, I6)")
    settled = r["survivors_settled_s"]
    print(f"survivors held nothing {settled} s after the load; isolation violations {r['violations']}"
          if settled is not None else f"survivors did NOT settle; isolation violations {r['violations']}")
    print(f"wall {r['wall_s']} s")
