"""A router stopped by SIGTERM takes no new connection, lets what is in flight run for
--shutdown-timeout, then ends the rest with 503 server_shutting_down (a stream's error event)
and exits; the nodes free what the ended requests held. Before, it waited on every stream for
as long as it ran (Kubernetes' grace period then cut the clients off with no word). A second
router on the shared cluster's nodes is the one stopped."""
from __future__ import annotations

import signal
import subprocess
import time

import httpx
from pd_cluster import ROOT, free_port
from shutdown_clients import LongClients, status


def test_sigterm_ends_what_outlives_the_routers_shutdown_timeout_with_a_503(shared_cluster, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "router2.log"
    p = subprocess.Popen(shared_cluster.command("router", ["--port", str(port), "--shutdown-timeout", "2"]), cwd=ROOT,
                         env=shared_cluster.env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    clients = LongClients(url, {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True})  # ~15 s
    try:
        deadline = time.monotonic() + 180
        while status(url) != 200:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        clients.start()
        deadline = time.monotonic() + 60
        while shared_cluster.info("decode")["snapshot"]["running"] < 2:   # both decoding
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(signal.SIGTERM)
        clients.join(60)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    log = log_path.read_text()
    clients.assert_ended_by_shutdown("--shutdown-timeout")
    assert "stopping (SIGTERM)" in log and "ended with 503 server_shutting_down" in log, log[-3000:]
    shared_cluster.wait_quiet(60)   # the nodes freed what the ended requests held


def test_the_routers_body_limit_is_the_one_it_was_given(shared_cluster, tmp_path):
    """`serve --role router --max-body-bytes N` was accepted and ignored: the router kept 8 MiB
    (found by a docs probe, reading launch-pd's options)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "router3.log"
    p = subprocess.Popen(shared_cluster.command("router", ["--port", str(port), "--max-body-bytes", "2000"]),
                         cwd=ROOT, env=shared_cluster.env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while status(url) != 200:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        small = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        big = httpx.post(url + "/v1/completions", json={"prompt": "Hi " * 1000, "max_tokens": 1}, timeout=60)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    assert small.status_code == 200, small.text
    assert big.status_code == 413, big.text
