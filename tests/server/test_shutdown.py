"""A single node stopped by SIGTERM takes no new connection, lets what is in flight run for
--shutdown-timeout, then ends the rest with 503 server_shutting_down (a stream's error event,
Retry-After on a plain answer) and exits. Before, it waited on every stream for as long as it
ran, and a supervisor's SIGKILL then cut the clients off with no word."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from server_harness import wait_for
from shutdown_clients import LongClients, status

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.params import SamplingParams
from kvfence.procs import free_ports
from kvfence.server.backend import EngineFailed
from kvfence.server.engine_loop import EngineLoop


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]])
def test_sigterm_ends_what_outlives_the_shutdown_timeout_with_a_503_the_client_reads(tmp_path, signals):
    """A second Ctrl-C ends them at once, their 503s still written (passed to uvicorn, it skipped
    the wait for the connections; found in review)."""
    timeout = "2" if len(signals) == 1 else "120"
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    p = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port), "--threads", "1",
                          "--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--shutdown-timeout", timeout],
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=open(log_path, "wb"),
                         stderr=subprocess.STDOUT)
    # 1800 tokens take ~25 s here: far past the 2 s deadline
    clients = LongClients(url, {"prompt": "Count to a thousand:", "max_tokens": 1800, "ignore_eos": True})
    try:
        assert wait_for(lambda: status(url) == 200, timeout=240), log_path.read_text()[-3000:]
        clients.start()
        assert wait_for(lambda: b'"POST /v1/completions HTTP/1.1" 200' in log_path.read_bytes(), timeout=60)
        time.sleep(1)
        for sig in signals:
            p.send_signal(sig)
            time.sleep(1)
        clients.join(60)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    log = log_path.read_text()
    clients.assert_ended_by_shutdown("--shutdown-timeout" if len(signals) == 1 else "a second SIGINT ended it")
    name = signals[0].name
    assert f"stopping ({name})" in log and f"2 request(s) in the engine have {timeout} s to finish" in log, log[-3000:]
    assert "ended with 503 server_shutting_down" in log
    assert status(url) == 0   # gone


def test_end_all_ends_every_request_with_its_code_gives_pages_back_and_takes_no_more(loaded_fp32):
    config = EngineConfig(dtype="float32", kv_cache_memory="16MiB", clamp_context=True, progress=False)
    loop = EngineLoop(lambda: LLMEngine(config, loaded_fp32)).start()
    assert loop.wait_ready(60), loop.error

    async def run() -> list:
        handles = [await loop.submit([1, 2, 3, 4 + i], SamplingParams(max_tokens=300, ignore_eos=True), tenant=t)
                   for i, t in enumerate(("alice", "bob"))]
        await handles[0].updates.get()        # running
        assert loop.end_all("server_shutting_down", "the deadline passed") == 2
        last = []
        for h in handles:
            while not (u := await h.updates.get()).finished:
                pass
            last.append(u)
        with pytest.raises(EngineFailed) as refused:   # what comes after is refused, with the same code
            await loop.submit([1, 2], SamplingParams(max_tokens=2), tenant="alice")
        assert refused.value.code == "server_shutting_down"
        return last

    try:
        last = asyncio.run(run())
        assert [(u.abort_code, u.error) for u in last] == [("server_shutting_down", "the deadline passed")] * 2
        assert wait_for(lambda: loop.snapshot.get("pages_owned") == 0 and loop.in_flight == 0, timeout=10), \
            loop.snapshot
    finally:
        loop.stop()
