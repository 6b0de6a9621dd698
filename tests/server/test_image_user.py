"""The image's run time without Docker (there is no daemon here): `kvfence serve` as the image's
unprivileged user, with no home (65534's is /nonexistent) and the folders the Dockerfile's ENV
names, made as its build makes them (owned by that user). Two ways it failed before: the
incident log under the home made every pod refuse to start, and kernels compiled under root's
~/.cache left every pod on plain torch ops."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


def image() -> tuple[dict[str, str], int, int]:
    """The Dockerfile's ENV folders (absolute paths, PATH aside) and its USER."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    env = {k: v for line in re.findall(r"^ENV (.+)$", text, re.M) for k, v in re.findall(r"(\w+)=(\S+)", line)
           if k != "PATH" and v.startswith("/")}
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user is not None
    return env, int(user[1]), int(user[2])


@pytest.fixture
def open_tmp():
    """A temporary folder that another user can reach (pytest's own sit under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="kvfence-image-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_image_user_serves_with_its_kernels_and_its_incident_log(open_tmp):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("becoming the image's user takes root and setpriv")
    env, uid, gid = image()
    assert {"KVFENCE_CACHE_DIR", "XDG_STATE_HOME"} <= env.keys(), env
    tmp_path = open_tmp
    folders = {}
    for name in env:   # each folder the image names, made here and given to its user as the build does
        folders[name] = tmp_path / name.lower()
        folders[name].mkdir()
        os.chown(folders[name], uid, gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "OMP_WAIT_POLICY": "PASSIVE",
               **{k: str(v) for k, v in folders.items()}}
    log = open(tmp_path / "serve.log", "w+")
    p = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-m",
                          "kvfence.cli", "serve", "--port", str(port), "--kv-cache-memory", "32MiB", "--clamp-context",
                          "--threads", "1"],
                         env=run_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert p.poll() is None, f"exited {p.returncode}: {(tmp_path / 'serve.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("ready"):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        info = [s.labels for f in text_string_to_metric_families(metrics) for s in f.samples
                if s.name == "kvfence_engine_info"]
        assert [i["kernels"] for i in info] == ["loaded"], info
        assert list(folders["KVFENCE_CACHE_DIR"].glob("cpu_kernels-*.so"))   # compiled by that user, there
        logs = list(folders["XDG_STATE_HOME"].glob("kvfence/incidents-*.jsonl"))
        assert [f.stat().st_uid for f in logs] == [uid], logs
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
