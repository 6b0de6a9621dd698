"""KV pages over the real Mooncake Transfer Engine between two real processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

try:
    import mooncake.engine  # noqa: F401
except ImportError as e:
    if os.environ.get("CI"):
        raise  # CI installs it (scripts/setup.sh); a missing engine there is a failure
    pytest.skip(f"mooncake transfer engine not importable ({e}); run scripts/setup.sh",
                allow_module_level=True)

from kvfence.pd.transfer import MAX_BATCH, PageTransport, TransferError  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PAGES, PAGE_BYTES = 64, 4096
TIMEOUT_S = 2

sys.path.insert(0, str(HERE))
from _peer import pattern  # noqa: E402


class Peer:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_peer.py"), str(PAGES), str(PAGE_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited before reporting (rc={self.proc.wait()})")
        info = json.loads(line)
        self.session, self.base = info["session"], info["base"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def transport():
    t = PageTransport(timeout_s=TIMEOUT_S)
    yield t
    t.close()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    if p.proc.poll() is None:
        os.kill(p.proc.pid, signal.SIGCONT)
    p.stop()


def test_pull_noncontiguous_pages(transport, peer):
    local = torch.zeros(16, PAGE_BYTES, dtype=torch.uint8)
    base = transport.register(local)
    pairs = [(3, 0), (17, 5), (40, 2), (63, 9), (8, 15)]
    moved = transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, pairs)
    assert moved == len(pairs) * PAGE_BYTES
    want = pattern(PAGES, PAGE_BYTES)
    written = {l for _, l in pairs}
    for r, l in pairs:
        assert torch.equal(local[l], want[r]), (r, l)
    for l in range(16):
        if l not in written:
            assert not local[l].any(), f"page {l} was not pulled but is not zero"
    transport.unregister(base)


def test_batches_over_the_engine_limit_are_chunked(transport, peer):
    # 2,500 small entries: one batch this size fails inside Mooncake
    n, size = 2500, 64
    local = torch.zeros(n * size, dtype=torch.uint8)
    base = transport.register(local)
    order = [(i * 37) % n for i in range(n)]  # scrambled, covers every slot once
    moved = transport.read(peer.session, [base + i * size for i in range(n)],
                           [peer.base + o * size for o in order], [size] * n)
    assert moved == n * size and n > 2 * MAX_BATCH
    want = pattern(PAGES, PAGE_BYTES).view(-1)
    got = local.view(n, size)
    for i in (0, 999, 1000, 1001, 2000, 2499):
        o = order[i]
        assert torch.equal(got[i], want[o * size:(o + 1) * size]), i
    transport.unregister(base)


def test_local_range_outside_pools_is_refused(transport, peer):
    local = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
    base = transport.register(local)
    with pytest.raises(ValueError, match="outside every registered pool"):
        transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, [(0, 4)])
    transport.unregister(base)


def test_dead_peer_fails_fast_with_clear_error(transport, peer):
    local = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
    base = transport.register(local)
    transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, [(1, 1)])  # connected
    peer.stop()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=peer.session):
        transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, [(2, 2)])
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    transport.unregister(base)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):  # every thread, not just the main one
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(st in "Tt" for st in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"peer {pid} did not stop")


def test_hung_peer_fails_within_the_timeout(transport, peer):
    local = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
    base = transport.register(local)
    transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, [(1, 1)])  # connected
    os.kill(peer.proc.pid, signal.SIGSTOP)  # alive, sockets open, never answers
    _wait_stopped(peer.proc.pid)  # delivery is asynchronous; a fast read could still win
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="failed"):
        transport.read_pages(peer.session, peer.base, base, PAGE_BYTES, [(2, 2)])
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    transport.unregister(base)
