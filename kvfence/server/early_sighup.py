"""A SIGHUP that comes before the server takes the signal itself is kept, not fatal.

Apart from the app so that the CLI sets it first thing, before it imports the server (and
torch, ~1 s): a start that is refused for its flags or secrets answers without loading either.
"""
from __future__ import annotations

import signal
import threading

EARLY_HUP = threading.Event()   # a SIGHUP came while no server took it (hold_sighup)


def hold_sighup() -> None:
    """Until the server takes SIGHUP itself (app._reload_on_sighup), and again once it stops, a
    SIGHUP is kept for later instead of its default action, which ends the process: launch-pd
    passes SIGHUP on to every child, one of them perhaps still loading its model."""
    try:
        signal.signal(signal.SIGHUP, lambda *_: EARLY_HUP.set())
        # launch-pd starts its children with SIGHUP blocked (procs.start_child): one sent while
        # this process imported is delivered now, to the handler
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    except ValueError:   # not the main thread
        pass
