"""One request's exception never takes the server down (issue: survive bad input and faults).

A poisoned request raises inside engine.step() (fault points poison_request: while its sampled
token is processed; poison_forward: in the forward pass, for the whole batch) while others
run: only it fails, with a 500 engine_error; the others get exactly the text they get without
the fault; the pool returns to baseline and the server keeps serving. When every request fails
even alone, several steps in a row, the engine is broken: the process exits non-zero so that a
supervisor restarts it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from server_harness import pool_intact, wait_for

from kvfence import faults
from kvfence.server.serve import EXIT_ENGINE_FAILED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POISON = 4242                                # a token id only the poisoned prompt contains
PROMPTS = {"a": [1, 504, 3575, 314, 4103, 28], "b": [1, 2377, 314, 253, 1160, 30], "p": [1, 504, POISON, 28, 30]}


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(tenants=None)


def complete(srv, ids) -> openai.types.Completion:
    return srv.client(None).completions.create(model=srv.state.served_name, prompt=ids, max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})


def concurrently(srv) -> dict:
    out: dict = {}

    def run(name):
        try:
            out[name] = complete(srv, PROMPTS[name]).choices[0].text
        except openai.APIStatusError as e:
            out[name] = e
    threads = [threading.Thread(target=run, args=(n,)) for n in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("point", ["poison_request", "poison_forward"])
def test_a_poisoned_request_fails_alone(srv, point):
    reference = {n: complete(srv, PROMPTS[n]).choices[0].text for n in ("a", "b")}
    with faults.injected(**{point: str(POISON)}):
        out = concurrently(srv)
    e = out["p"]
    assert isinstance(e, openai.InternalServerError) and e.code == "engine_error", e
    assert out["a"] == reference["a"] and out["b"] == reference["b"], out
    assert srv.engine.state == "ready"
    wait_for(lambda: pool_intact(srv.wait_idle()))
    assert pool_intact(srv.engine.snapshot), srv.engine.snapshot
    assert complete(srv, PROMPTS["p"]).choices[0].finish_reason == "length"   # fault off: it runs again


def test_a_broken_engine_makes_the_process_exit_for_its_supervisor(tmp_path):
    port = _free_port()
    env = {**os.environ, "KVFENCE_TEST_FAULTS": f"poison_forward:{POISON}", "OMP_WAIT_POLICY": "PASSIVE"}
    log = open(tmp_path / "serve.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port), "--dtype", "float32",
                          "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--threads", "1"],
                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(url + "/health"), timeout=180)
        body = {"prompt": PROMPTS["p"], "max_tokens": 4}
        for _ in range(3):   # each fails alone: three steps in a row in which nothing could run
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code in (500, 503), r.text
        assert p.wait(30) == EXIT_ENGINE_FAILED
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    text = (tmp_path / "serve.log").read_text(errors="replace")
    assert "EngineBroken" in text and f"exit code {EXIT_ENGINE_FAILED}" in text, text[-3000:]


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    from kvfence.procs import free_ports

    return free_ports(1)

