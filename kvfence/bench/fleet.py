"""`kvfence bench --fleet`: prefix-affinity routing against round robin on a PD fleet.

Twice, on fresh processes (cold caches): a fleet as `kvfence launch-pd --prefill P
--decode D` starts it, the router with `--prefill-routing affinity`, then `round-robin`.
The workload: T tenants, each with its own system prompt of --prompt-tokens words (the same
leading pages for every request of that tenant), --num-requests requests per tenant with a
short question after it, C in flight,
greedy, streamed. Reported per mode: the prefill nodes' prefix-cache hit tokens as a share
of all prompt tokens, TTFT percentiles, wall time, and the ratios between the modes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import httpx

from kvfence.bench.http_load import make_prompt, sse_messages
from kvfence.bench.pd import HOST, Procs, pd_commands
from kvfence.bench.stats import percentiles
from kvfence.pd.messages import NodeInfo
from kvfence.pd.tls import FOLLOW_PROXY_ENV
from kvfence.procs import free_ports

TENANTS, QUESTION_WORDS, CONCURRENCY, MAX_TOKENS = 4, 12, 4, 4


SCRAPE = {"Authorization": "Bearer sk-bench-scraper-01"}   # the router shows its nodes to this key only


def _tenants_file(path: Path, n: int) -> list[str]:
    keys = [f"sk-bench-tenant-{i:04d}" for i in range(n)]
    path.write_text("".join(f'[tenants.t{i}]\napi_keys = ["{k}"]\n\n' for i, k in enumerate(keys))
                    + '[metrics]\napi_keys = ["sk-bench-scraper-01"]\n')
    return keys


async def _one(http: httpx.AsyncClient, url: str, key: str, model: str, prompt: str) -> tuple[float, int]:
    """(TTFT in seconds, prompt tokens) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, prompt_tokens = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", url + "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for msg in sse_messages(r):
            if ttft is None and msg.get("choices") and msg["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if msg.get("usage"):
                prompt_tokens = msg["usage"]["prompt_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), prompt_tokens


async def _workload(url: str, keys: list[str], model: str, seed: int, system_words: int, per_tenant: int) -> dict:
    systems = [make_prompt(0, system_words, seed=100 + t) for t in range(len(keys))]
    jobs = [(keys[t], f"{systems[t]}\nQuestion {i}: {make_prompt(i, QUESTION_WORDS, seed=200 + t)}")
            for t in range(len(keys)) for i in range(per_tenant)]
    random.Random(seed).shuffle(jobs)
    sem = asyncio.Semaphore(CONCURRENCY)
    out: list[tuple[float, int]] = []

    async def run(key: str, prompt: str) -> None:
        async with sem:
            out.append(await _one(http, url, key, model, prompt))
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(run(k, p) for k, p in jobs))
    return {"ttft_ms": percentiles([t for t, _ in out]), "prompt_tokens": sum(n for _, n in out),
            "requests": len(out), "wall_s": round(time.perf_counter() - t0, 2)}


def run_mode(a, mode: str, logdir: Path, timeout: float = 600.0) -> dict:
    n_nodes = a.prefill + a.decode
    port = free_ports(n_nodes + 1)
    (logdir / mode).mkdir(parents=True, exist_ok=True)
    procs = Procs(logdir / mode)                 # one cluster secret per fleet
    keys = _tenants_file(logdir / mode / "tenants.toml", TENANTS)
    cmds = pd_commands(a, port, procs.secret_file)
    cmds["router"] += ["--tenants", str(logdir / mode / "tenants.toml"), "--prefill-routing", mode]
    url = f"http://{HOST}:{port}"
    try:
        for name, cmd in cmds.items():
            procs.start(name, cmd)
        procs.wait(lambda: (s := httpx.get(url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=2).json())["ready"] and
                   all(n["state"] == "ready" for n in s["nodes"]), f"the fleet ({mode})", timeout)
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {keys[0]}"},
                          timeout=30).json()["data"][0]["id"]
        result = asyncio.run(_workload(url, keys, model, getattr(a, "seed", None) or 0, a.prompt_tokens,
                                       a.num_requests))
        nodes = httpx.get(url + "/v1/kvfence/cluster", headers=SCRAPE, timeout=10).json()["nodes"]
        hits = 0
        for n in nodes:
            if n["role"] == "prefill":
                info = NodeInfo.from_json(httpx.get(n["url"] + "/internal/info", headers=procs.internal_headers,
                                                    timeout=10, trust_env=FOLLOW_PROXY_ENV).content)
                hits += int(info.snapshot.get("prefix_cache_hit_tokens", 0))
        result.update(mode=mode, prefix_hit_tokens=hits,
                      hit_rate=round(hits / result["prompt_tokens"], 3) if result["prompt_tokens"] else 0.0,
                      routed={n["url"]: n["routed"] for n in nodes})
        return result
    finally:
        procs.stop()


def main(a) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    a.kv_cache_memory = a.kv_cache_memory or "512MiB"
    a.prefill, a.decode = a.prefill or 2, a.decode or 2
    a.num_requests = a.num_requests or 8       # per tenant
    a.prompt_tokens = a.prompt_tokens or 160   # words of each tenant's system prompt
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-fleet-") as tmp:
        results = {}
        for i, mode in enumerate(("affinity", "round-robin"), start=1):
            print(f"[{i}/2] fleet of {a.prefill} prefill + {a.decode} decode nodes, prefill routing {mode} ...",
                  flush=True)
            results[mode] = run_mode(a, mode, Path(tmp))
    aff, rr = results["affinity"], results["round-robin"]
    print(f"\n{TENANTS} tenants x {a.num_requests} requests, system prompt {a.prompt_tokens} words, "
          f"{CONCURRENCY} in flight")
    print(f"{'routing':<12} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'wall s':>8}")
    for r in (aff, rr):
        print(f"{r['mode']:<12} {r['hit_rate']:>9.3f} {r['ttft_ms']['p50']:>8.0f}ms {r['ttft_ms']['p90']:>8.0f}ms "
              f"{r['wall_s']:>8.1f}")
    ratio = round(aff["ttft_ms"]["p50"] / rr["ttft_ms"]["p50"], 3) if rr["ttft_ms"].get("p50") else None
    print(f"TTFT p50 affinity / round-robin: {ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps({"affinity": aff, "round_robin": rr, "ttft_p50_ratio": ratio}, indent=2))
    return 0 if aff["requests"] == rr["requests"] == TENANTS * a.num_requests else 1
