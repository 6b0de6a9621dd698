"""Stopping the processes kvfence starts (launch-pd, benches, test clusters), one way."""
from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 20.0, wake: bool = False) -> None:
    """SIGTERM every process still running, wait up to grace_s for each, then SIGKILL the
    rest. wake: send SIGCONT first, so a process a test stopped can act on the SIGTERM."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            if wake:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
