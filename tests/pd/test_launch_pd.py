"""`kvfence launch-pd` as an operator runs it: the three processes come up with a secret it
made, a node that dies is started again and re-checked by the router, and the cluster serves
again; SIGTERM stops everything."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from pd_cluster import ROOT, wait_until

from kvfence.procs import free_ports

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")


def _boot(state: dict, role: str) -> str | None:
    """The boot id of the ready node of `role` in a /v1/kvfence/cluster answer."""
    return next((n["boot_id"] for n in state["nodes"] if n["role"] == role and n["state"] == "ready"), None)


def cluster_state(url: str) -> dict | None:
    try:
        r = httpx.get(url + "/v1/kvfence/cluster", timeout=3)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def test_launch_pd_restarts_a_node_that_dies(tmp_path):
    port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_SECRET")}
    log = open(tmp_path / "launch.log", "w+")
    p = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "launch-pd", "--port", str(port), "--dtype", "bfloat16",
                          "--kv-cache-memory", "32MiB", "--max-model-len", "1024"], cwd=ROOT, env=env,
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        first = wait_until(lambda: (s := cluster_state(url)) and s["ready"] and s, 240, "the cluster ready",
                           interval=0.5)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        assert c.completions.create(model=model, prompt="Hello", max_tokens=2).choices
        log.flush()
        text = (tmp_path / "launch.log").read_text()
        secret_file = re.search(r"made a random cluster secret for this cluster in (\S+)", text).group(1)
        assert os.path.exists(secret_file) and not re.search(r"[0-9a-f]{64}", text)   # the path, never the secret
        pid = int(re.search(r"started prefill on port \d+ \(pid (\d+)\)", text).group(1))
        os.kill(pid, signal.SIGKILL)
        # a ready prefill node with a new boot id: with none ready _boot is None, which also
        # differs from the first boot (CI caught the router between marking the node down and
        # leaving "ready", and the completion below got a 503)
        again = wait_until(lambda: (s := cluster_state(url)) and s["ready"] and
                           _boot(s, "prefill") not in (None, _boot(first, "prefill")) and s, 240,
                           "the cluster ready on a new prefill boot", interval=0.5)
        assert again["check"]["ok"]
        assert c.completions.create(model=model, prompt="Hello", max_tokens=2).choices
        assert "restarted it" in (tmp_path / "launch.log").read_text()
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    assert not os.path.exists(secret_file)   # removed on exit

