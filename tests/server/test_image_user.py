"""The image's run time without Docker (there is no daemon here): `kvfence serve` as the image's
unprivileged user, with no home (65534's is /nonexistent) and the folders the Dockerfile's ENV
names, made as its build makes them (owned by that user). Two ways it failed before: the
incident log under the home made every pod refuse to start, and kernels compiled under root's
~/.cache left every pod on plain torch ops."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
from image_env import as_image_user, become_image_user_or_skip, image, image_env
from prometheus_client.parser import text_string_to_metric_families

from kvfence.procs import free_ports, stop_processes


def test_the_image_user_serves_with_its_kernels_and_its_incident_log(open_tmp):
    become_image_user_or_skip()
    env, uid, _ = image()
    assert {"KVFENCE_CACHE_DIR", "XDG_STATE_HOME"} <= env.keys(), env
    run_env = image_env(open_tmp)
    port = free_ports(1)
    log = open(open_tmp / "serve.log", "w+")
    p = subprocess.Popen(as_image_user([sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port),
                                        "--kv-cache-memory", "32MiB", "--clamp-context", "--threads", "1"]),
                         env=run_env, cwd=open_tmp, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert p.poll() is None, f"exited {p.returncode}: {(open_tmp / 'serve.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("ready"):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (open_tmp / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        info = [s.labels for f in text_string_to_metric_families(metrics) for s in f.samples
                if s.name == "kvfence_engine_info"]
        assert [i["kernels"] for i in info] == ["loaded"], info
        cache, state = open_tmp / "kvfence_cache_dir", open_tmp / "xdg_state_home"
        assert list(cache.glob("cpu_kernels-*.so"))   # compiled by that user, there
        logs = list(state.glob("kvfence/incidents-*.jsonl"))
        assert [f.stat().st_uid for f in logs] == [uid], logs
        # `kubectl exec POD -- kvfence incidents` finds it there by itself
        r = subprocess.run(as_image_user([sys.executable, "-m", "kvfence.cli", "incidents", "--verify"]),
                           env=run_env, cwd=open_tmp, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"{logs[0]}: ok" in r.stdout, (r.stdout, r.stderr)
    finally:
        stop_processes([p], grace_s=30)
        log.close()
