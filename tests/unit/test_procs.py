"""Processes kvfence starts die with the process that started them, however it dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

LAUNCHER = """
import sys, time
from kvfence.procs import start_child
child = start_child([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:      # a zombie waiting for its reaper is gone for our purpose
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_is_stopped_when_its_launcher_is_sigkilled():
    # found in review: a SIGKILLed launch-pd left its nodes running, holding ports and KV pools
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        for _ in range(100):
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
