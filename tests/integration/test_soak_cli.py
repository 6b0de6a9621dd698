"""`kvfence soak` runs end to end for a few seconds with faults switching, and its
summary can fail: a leaked row is reported."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfence.bench.soak import SoakSummary
from kvfence.cli import main

pytest.importorskip("mooncake.engine", reason="soak needs mooncake-transfer-engine-non-cuda")


def test_soak_short_run_passes_and_reports(tmp_path):
    out = tmp_path / "soak.json"
    rc = main(["soak", "--duration", "7s", "--concurrency", "2", "--fault-every", "2", "--fault-length", "2",
               "--sample-every", "3", "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data
    assert data["requests"] > 0 and data["leaked"] == {} and data["hung"] == 0
    assert sum(data["faults_injected"].values()) >= 1 and len(data["samples"]) >= 2
    assert set(data["rss_mib"]) == {"prefill", "decode", "router"}


def test_ctrl_c_still_prints_what_the_soak_saw(tmp_path):
    # an hour's soak stopped by hand reported nothing: its outcomes and samples were lost
    out = tmp_path / "soak.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "soak", "--duration", "10m", "--concurrency", "2",
                             "--no-faults", "--sample-every", "2", "--kv-cache-memory", "32MiB", "--max-model-len",
                             "256", "--json", str(out), "--logdir", str(tmp_path / "logs")],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert "cluster up" in proc.stdout.readline()   # the first line once the cluster serves
        time.sleep(3)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "INTERRUPTED" in stdout and "not checked (interrupted)" in stdout, stdout
    data = json.loads(out.read_text())
    assert data["interrupted"] and data["requests"] > 0 and len(data["samples"]) >= 1


def test_soak_summary_fails_on_a_leak_or_an_unexplained_error():
    base = dict(seconds=1.0, requests=3, outcomes={"200": 3}, unexplained_errors=0, hung=0, latency_ms={},
                rss_mib={}, faults_injected={}, leaked={})
    assert SoakSummary(**base).ok
    assert not SoakSummary(**{**base, "leaked": {"prefill": {"buffer_rows_not_free": 2}}}).ok
    assert not SoakSummary(**{**base, "unexplained_errors": 1}).ok
    assert "FAIL" in SoakSummary(**{**base, "hung": 1}).text()
    assert not SoakSummary(**base, interrupted=True).ok   # a soak cut short passes nothing


def test_a_stream_refused_before_it_began_is_named_by_its_code():
    """Since the router answers a failed handoff before a stream begins, a stream's fault shows
    as an HTTP status; the soak blames a fault by the code, so it must read it (it took the bare
    status: every such stream was an error no fault explained, and a clean-clone CI run's short
    soak failed)."""
    from kvfence.bench.soak import FAULT_CODES, _outcome

    assert _outcome(500, b'{"error": {"code": "kv_verification_failed"}}') == "500:kv_verification_failed"
    assert _outcome(500, b'{"error": {"code": "kv_verification_failed"}}').split(":")[-1] in FAULT_CODES
    assert _outcome(200, b"") == "200" and _outcome(400, b"{}") == "400" and _outcome(503, b"not json") == "503:None"
