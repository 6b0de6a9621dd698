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


HANGUP_CHILD = """
import signal, sys, time
time.sleep(1.0)   # importing: a SIGHUP arrives now
got = []
signal.signal(signal.SIGHUP, lambda *_: got.append(1))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})   # as kvfence's hold_sighup does
time.sleep(0.2)
sys.exit(0 if got else 3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child's mask is set between fork and exec")
def test_a_hangup_sent_while_a_child_starts_waits_for_its_handler():
    """launch-pd passes SIGHUP on to every child; one still importing (no handler yet) was
    ended by it (found in review: a dead router stops the whole launch-pd cluster)."""
    from kvfence.procs import start_child

    child = start_child([sys.executable, "-c", HANGUP_CHILD], hold_hangup=True)
    time.sleep(0.3)
    child.send_signal(signal.SIGHUP)
    assert child.wait(30) == 0        # alive, and the handler got it once it was there
