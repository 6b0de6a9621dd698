"""`kvfence bench --pd`: disaggregated prefill/decode against a single node, in one run.

1. A single-node `kvfence serve` process; the HTTP load workload (`bench --url`'s, N
   streaming requests all in flight, greedy, ignore_eos) through it; stop it.
2. A PD cluster as `kvfence launch-pd` starts it (prefill, decode and router processes,
   the cores split between the nodes, OMP_WAIT_POLICY=PASSIVE); the same workload through
   the router; the decode node's transfer counters before and after.
   Then a few requests of the same size one at a time: their pulls run on idle cores.
3. Raw Mooncake on this machine: two processes, one registers a buffer of rows the size
   of kvfence's transfer rows, the other reads a request's worth of whole rows per batch
   (one `batch_transfer_sync_read`, as kvfence's pull does), as many batches as kvfence
   made pulls.

Throughput, TTFT and ITL percentiles for both modes and their ratios; kvfence's pull
bandwidth (bytes / summed pull time, as the decode node reports it) against raw
Mooncake's. Quote the ratios from one run, not the absolute numbers: the machine is shared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from kvfence.bench.http_load import Report, format_report, make_prompt, run_load
from kvfence.cores import usable_cores
from kvfence.pd.launch import ENGINE_FLAGS, flags, node_commands, write_secret_file
from kvfence.pd.messages import NodeInfo
from kvfence.pd.seal import load_secret
from kvfence.pd.tls import FOLLOW_PROXY_ENV
from kvfence.pd.wire import cluster_headers
from kvfence.procs import free_ports, start_child, stop_processes

DEFAULTS = {"num_requests": 16, "prompt_tokens": 256, "output_tokens": 64, "kv_cache_memory": "512MiB"}
HOST = "127.0.0.1"
SEQUENTIAL = 4  # requests sent one at a time after the load: pulls on idle cores


# -- processes -----------------------------------------------------------------------------------

class Procs:
    """Server processes of one mode, their logs in `logdir`; stop() ends them all."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        # their incident logs stay with their other logs: under ~/.local/state, `kvfence
        # incidents` reported a bench's or soak's faults as the host's own
        self.env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1",
                        XDG_STATE_HOME=str(logdir / "state"))
        self.secret_file = write_secret_file(str(logdir))  # PD processes started here share it

    @property
    def internal_headers(self) -> dict[str, str]:
        """The credential for the nodes' internal routes."""
        return cluster_headers(load_secret(self.secret_file))

    def start(self, name: str, cmd: list[str]) -> None:
        with open(self.logdir / f"{name}.log", "ab") as log:
            self.procs[name] = start_child(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, name: str, n: int = 2500) -> str:
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait(self, ready, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode} before {what} was ready:\n"
                                       f"{self.log_tail(name)}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{what} was not ready within {timeout:.0f} s:\n" +
                           "\n".join(f"--- {n}\n{self.log_tail(n, 1500)}" for n in self.procs))

    def stop(self) -> None:
        stop_processes(self.procs.values(), grace_s=30)
        Path(self.secret_file).unlink(missing_ok=True)   # the logs stay; the cluster's secret does not


def single_node_command(a, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--host", HOST, "--port", str(port),
           "--threads", str(a.threads or usable_cores())]
    return cmd + flags(a, ENGINE_FLAGS)


def pd_commands(a, port: int, secret_file: str) -> dict[str, list[str]]:
    """Exactly what `kvfence launch-pd --port PORT` would start (router on PORT, nodes after)."""
    return node_commands(argparse.Namespace(**{**vars(a), "host": HOST, "port": port, "tenants": None,
                                               "served_model_name": None, "verbose": False}), secret_file)


def _load(url: str, a) -> Report:
    return asyncio.run(run_load(url, a.num_requests, a.concurrency or a.num_requests, a.prompt_tokens,
                                a.output_tokens, timeout=a.timeout))


def run_single(a, logdir: Path, timeout: float) -> Report:
    port = free_ports(1)
    procs = Procs(logdir)
    try:
        procs.start("single", single_node_command(a, port))
        url = f"http://{HOST}:{port}"
        procs.wait(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, "the single node", timeout)
        return _load(url, a)
    finally:
        procs.stop()


def _decode_info(url: str, headers: dict[str, str]) -> NodeInfo:
    r = httpx.get(url + "/internal/info", headers=headers, timeout=30, trust_env=FOLLOW_PROXY_ENV)
    r.raise_for_status()
    return NodeInfo.from_json(r.content)


def _pulls(before: NodeInfo, after: NodeInfo) -> dict:
    """The decode node's pulls between two /internal/info snapshots."""
    b, e = before.snapshot["pd"], after.snapshot["pd"]
    pulls = e.get("pd_verified", 0) - b.get("pd_verified", 0)
    nbytes = e["transferred_bytes"] - b["transferred_bytes"]
    seconds = e["transfer_seconds"] - b["transfer_seconds"]
    opened = e.get("open_seconds", 0.0) - b.get("open_seconds", 0.0)
    slot = after.pd.slot_bytes
    return {"pulls": pulls, "bytes": nbytes, "seconds": round(seconds, 4), "row_bytes": slot,
            "rows_per_pull": round(nbytes / slot / pulls, 2) if pulls else 0.0,
            "bytes_per_pull": round(nbytes / pulls) if pulls else 0,
            "mib_per_s": round(nbytes / seconds / 2**20, 1) if seconds > 0 else None,
            "session": after.pd.transfer_session,
            "open_mib_per_s": round(nbytes / opened / 2**20, 1) if opened > 0 else None}


def run_pd(a, logdir: Path, timeout: float) -> tuple[Report, dict, dict]:
    """The load through the router; then a few requests of the same size one at a time, so
    their pulls run with nothing else on the cores (kvfence's own cost, not contention's)."""
    port = free_ports(3)
    router, decode = f"http://{HOST}:{port}", f"http://{HOST}:{port + 2}"
    procs = Procs(logdir)
    try:
        cmds = pd_commands(a, port, procs.secret_file)
        for role in ("prefill", "decode", "router"):
            procs.start(role, cmds[role])
        procs.wait(lambda: httpx.get(router + "/v1/kvfence/cluster", timeout=2).json()["ready"], "the PD cluster",
                   timeout)
        model = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]

        def one(prompt: str, max_tokens: int) -> None:
            httpx.post(router + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0.0}, timeout=a.timeout).raise_for_status()

        # one request first: the transfer engines' first contact (P2P handshake) is not
        # part of any measured pull
        one("warm up", 2)
        before = _decode_info(decode, procs.internal_headers)
        report = _load(router, a)
        after = _decode_info(decode, procs.internal_headers)
        for i in range(SEQUENTIAL):
            one(make_prompt(i, a.prompt_tokens, seed=1), 1)
        idle = _pulls(after, _decode_info(decode, procs.internal_headers))
        return report, _pulls(before, after), idle
    finally:
        procs.stop()


# -- raw Mooncake ---------------------------------------------------------------------------------

def _raw_peer(rows: int, row_bytes: int) -> None:
    """The owner side: one registered buffer of rows; serves until stdin closes."""
    import torch

    from kvfence.pd.transfer import PageTransport

    buf = (torch.arange(rows * row_bytes, dtype=torch.int64) % 251 + 1).to(torch.uint8).view(rows, row_bytes)
    t = PageTransport(HOST)
    base = t.register(buf)
    print(json.dumps({"session": t.session_id, "base": base}), flush=True)
    sys.stdin.read()


def raw_mooncake(rows: int, row_bytes: int, batches: int) -> dict:
    """Read `rows` whole rows of `row_bytes` from another process in one batch, `batches`
    times after a warm-up read (the handshake); bandwidth = bytes / summed read time."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO/WARNING lines would bury the table
    import torch

    from kvfence.pd.transfer import PageTransport

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    peer = subprocess.Popen([sys.executable, "-m", "kvfence.bench.pd", "--raw-peer", str(rows), str(row_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        hello = json.loads(peer.stdout.readline() or "{}")
        if "session" not in hello:
            raise RuntimeError(f"the raw Mooncake peer did not start (exit code {peer.poll()})")
        local = torch.zeros(rows, row_bytes, dtype=torch.uint8)
        t = PageTransport(HOST)
        lbase = t.register(local)
        locs = [lbase + i * row_bytes for i in range(rows)]
        rems = [hello["base"] + i * row_bytes for i in range(rows)]
        t.read(hello["session"], locs, rems, [row_bytes] * rows)  # warm-up: the handshake
        times = []
        for _ in range(batches):
            local.zero_()
            t0 = time.perf_counter()
            t.read(hello["session"], locs, rems, [row_bytes] * rows)
            times.append(time.perf_counter() - t0)
        want = (torch.arange(rows * row_bytes, dtype=torch.int64) % 251 + 1).to(torch.uint8).view(rows, row_bytes)
        if not torch.equal(local, want):
            raise RuntimeError("raw Mooncake read returned the wrong bytes")
        t.close()
        nbytes = rows * row_bytes * batches
        return {"pulls": batches, "bytes": nbytes, "seconds": round(sum(times), 4), "row_bytes": row_bytes,
                "rows_per_pull": rows, "bytes_per_pull": rows * row_bytes,
                "mib_per_s": round(nbytes / sum(times) / 2**20, 1),
                "read_ms_p50": round(statistics.median(times) * 1e3, 2), "session": hello["session"]}
    finally:
        peer.stdin.close()
        try:
            peer.wait(30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait(10)


# -- sealing ---------------------------------------------------------------------------------------

def seal_throughput(row_bytes: int, rows: int, rounds: int = 5) -> dict:
    """AES-256-GCM on this machine, one thread, rows of kvfence's size: seal (prefill, into
    the registered row) and open (decode, from a private copy), as pd/staging.py does."""
    from kvfence.pd.seal import TAG_BYTES, RowCipher, new_salt

    data = row_bytes - TAG_BYTES
    plain = np.random.default_rng(0).integers(0, 256, (rows, data), dtype=np.uint8)
    sealed = np.empty((rows, row_bytes), dtype=np.uint8)
    out = np.empty((rows, data), dtype=np.uint8)
    cipher = RowCipher(b"b" * 32, new_salt(), "boot", "request", "tenant")
    aad = b"h" * 108
    best_seal = best_open = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(rows):
            cipher.seal_into(i, plain[i].data, aad, sealed[i].data)
        t1 = time.perf_counter()
        for i in range(rows):
            cipher.open_into(i, sealed[i].tobytes(), aad, out[i].data)
        t2 = time.perf_counter()
        best_seal, best_open = min(best_seal, t1 - t0), min(best_open, t2 - t1)
    assert np.array_equal(out, plain)
    nbytes = rows * data
    return {"rows": rows, "row_bytes": row_bytes, "seal_mib_per_s": round(nbytes / best_seal / 2**20, 1),
            "open_mib_per_s": round(nbytes / best_open / 2**20, 1)}


# -- report ---------------------------------------------------------------------------------------

def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def ratios(single: Report, pd: Report) -> dict:
    out = {"output_tps": _ratio(pd.output_tps, single.output_tps)}
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        for q in ("p50", "p90", "p99"):
            out[f"{k}_{q}"] = _ratio(getattr(pd, k).get(q), getattr(single, k).get(q))
    return out


def format_table(single: Report, pd: Report, r: dict, kv: dict, idle: dict, raw: dict, seal: dict, a) -> str:
    def ms(rep, k, q):
        v = getattr(rep, k).get(q)
        return "-" if v is None else f"{v:.1f}"

    rows = [("output tok/s", f"{single.output_tps:.1f}", f"{pd.output_tps:.1f}", r["output_tps"]),
            ("requests ok", f"{single.ok}/{single.num_requests}", f"{pd.ok}/{pd.num_requests}", None)]
    for k, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("latency_ms", "latency")):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{label} {q} ms", ms(single, k, q), ms(pd, k, q), r[f"{k}_{q}"]))
    w = "{:<18}{:>14}{:>14}{:>14}"
    lines = [f"kvfence bench --pd: {a.num_requests} requests x ~{a.prompt_tokens}-word prompts "
             f"({pd.prompt_tokens or '?'} prompt tokens in all) -> {a.output_tokens} tokens, "
             f"{a.concurrency or a.num_requests} in flight, greedy, {a.dtype}, {usable_cores()} cores",
             "", w.format("", "single node", "PD", "PD / single")]
    lines += [w.format(n, s, p, "-" if x is None else f"{x:.2f}") for n, s, p, x in rows]
    t = "{:<28}{:>10}{:>14}{:>10}{:>10}{:>9}"
    lines += ["", "KV transfer: decode pulls prefill's rows over Mooncake TCP, one batch of whole rows per request",
              t.format("", "transfers", "rows x bytes", "MiB each", "MiB/s", "vs raw")]
    for name, x in (("kvfence, during the load", kv), ("kvfence, one at a time", idle), ("raw Mooncake", raw)):
        bw = "-" if x["mib_per_s"] is None else f"{x['mib_per_s']:.1f}"
        vs = _ratio(x["mib_per_s"], raw["mib_per_s"])
        lines.append(t.format(name, x["pulls"], f"{x['rows_per_pull']:g} x {x['row_bytes']}",
                              f"{x['bytes_per_pull'] / 2**20:.2f}", bw, "-" if vs is None else f"{vs:.2f}"))
    lines.append("  MiB/s = bytes / summed pull time (the decode node's counters). During the load up to 4 pulls run "
                 "at once while the cores compute; one at a time, nothing else runs; raw: the same rows between two "
                 "processes, one batch at a time, after the PD cluster stopped.")
    vs_seal = _ratio(seal["seal_mib_per_s"], raw["mib_per_s"])
    vs_open = _ratio(seal["open_mib_per_s"], raw["mib_per_s"])
    lines.append(f"Sealing (AES-256-GCM, one thread, {seal['rows']} rows of {seal['row_bytes']} bytes): seal "
                 f"{seal['seal_mib_per_s']:.0f} MiB/s, open {seal['open_mib_per_s']:.0f} MiB/s = {vs_seal}x / "
                 f"{vs_open}x raw Mooncake's bandwidth.")
    lines.append(f"Decode opened the pulled rows (authenticate, decrypt, copy into the pool) at "
                 f"{kv.get('open_mib_per_s')} MiB/s during the load and {idle.get('open_mib_per_s')} MiB/s one at a "
                 "time, on its engine thread after each pull (not in the pull times above)")
    return "\n".join(lines)


def main(a) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for k, v in DEFAULTS.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    timeout = 600.0
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-pd-") as tmp:
        logdir = Path(tmp)
        print("[1/3] single node: starting kvfence serve ...", flush=True)
        single = run_single(a, logdir, timeout)
        print(format_report(single), flush=True)
        print("[2/3] PD: starting prefill, decode and router ...", flush=True)
        pd, kv, idle = run_pd(a, logdir, timeout)
        print(format_report(pd), flush=True)
    print("[3/3] raw Mooncake between two processes ...", flush=True)
    rows = max(1, round(kv["rows_per_pull"]))
    raw = raw_mooncake(rows, kv["row_bytes"], max(4, kv["pulls"]))
    for x in (kv, idle):
        x["vs_raw"] = _ratio(x["mib_per_s"], raw["mib_per_s"])
    seal = seal_throughput(kv["row_bytes"], max(rows, 16))
    r = ratios(single, pd)
    print()
    print(format_table(single, pd, r, kv, idle, raw, seal, a))
    if a.json:
        doc = {"workload": {"num_requests": a.num_requests, "prompt_words": a.prompt_tokens,
                            "output_tokens": a.output_tokens, "concurrency": a.concurrency or a.num_requests,
                            "dtype": a.dtype, "kv_cache_memory": a.kv_cache_memory,
                            "cores": usable_cores()},
               "single": asdict(single), "pd": asdict(pd), "ratios": r,
               "transfer": {"kvfence_under_load": kv, "kvfence_one_at_a_time": idle, "raw_mooncake": raw},
               "sealing": seal}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(a.json, doc, "kvfence bench --pd: one node against prefill + decode")
    ok = single.ok == single.num_requests and pd.ok == pd.num_requests and kv["pulls"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--raw-peer":
        _raw_peer(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit("usage: python -m kvfence.bench.pd --raw-peer ROWS ROW_BYTES (use `kvfence bench --pd`)")
