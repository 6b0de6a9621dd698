"""The processes kvfence starts (launch-pd, benches, test clusters): their ports, and stopping them."""
from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable

# Ports for servers this project starts, picked below the kernel's ephemeral range (32768-60999
# on Linux) and above Mooncake's own (15xxx-16xxx seen): a port picked from the ephemeral range
# by binding port 0 could be taken by another process's outgoing or transfer-engine socket
# between the check and the server's bind (seen once in CI: "address already in use").
PORT_RANGE = (20000, 32000)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port with base .. base+n-1 all free now, outside the ephemeral range."""
    lo, hi = PORT_RANGE
    for _ in range(500):
        base = random.randrange(lo, hi - n)
        if all(_bindable(host, base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free ports in {lo}-{hi}")


PR_SET_PDEATHSIG = 1   # linux/prctl.h


def start_child(cmd: list[str], hold_hangup: bool = False, **popen) -> subprocess.Popen:
    """Popen, and on Linux the child is sent SIGTERM when the process that started it dies,
    however it dies (SIGKILL, OOM): a killed launch-pd or bench leaves no node holding its
    port and its KV pool. SIGTERM, not SIGKILL, so that a node drains as it would if stopped.
    Linux sends it when the *thread* that started the child ends: call this from the main
    thread (every caller does), not from a worker thread that finishes first.

    hold_hangup: the child starts with SIGHUP blocked, so a SIGHUP passed on while it is still
    importing waits for it instead of ending it (a `kvfence serve` unblocks it once it has a
    handler: kvfence.server.early_sighup.hold_sighup)."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(cmd, **popen)   # stop_processes at exit is all there is
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up here: the child only calls it

    def die_with_parent() -> None:   # runs in the child between fork and exec
        if hold_hangup:   # a signal mask outlives exec
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:   # the parent died before prctl took hold
            os.kill(os.getpid(), signal.SIGTERM)

    return subprocess.Popen(cmd, preexec_fn=die_with_parent, **popen)


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
