"""A single node's or a PD router's stop on SIGTERM (or Ctrl-C): take no new connection, give
the requests in flight --shutdown-timeout seconds to finish, then end the rest with 503
server_shutting_down (a stream's error event), so that each client reads why and may retry
elsewhere, instead of a cut connection or a process that waits on a long stream until the
supervisor kills it.

A second signal ends them at once (their 503s still written); a third Ctrl-C stops without
waiting.
uvicorn's own graceful-shutdown timeout is set a little past the deadline as a backstop: it
cancels what is still open then (a request still being read or checked when the engine
stopped taking requests ends with the same 503 on its way in).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from kvfence.server.backend import EngineBackend

log = logging.getLogger("kvfence.server")

SHUTTING_DOWN = "server_shutting_down"   # the abort code (errors.ABORT_STATUS)
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0   # inside Kubernetes' default 30 s grace period, with room to answer
BACKSTOP_S = 5.0   # uvicorn cancels what is left this long after the deadline


class GracefulStop:
    def __init__(self, server: Any, engine: EngineBackend, timeout_s: float):
        self.server, self.engine, self.timeout_s = server, engine, timeout_s
        self.since: float | None = None
        self.signals = 0
        self._ended = threading.Event()
        # re-entrant: the handler runs on the main thread, and a signal may come while it holds it
        self._lock = threading.RLock()

    def install(self) -> None:
        """Take the uvicorn server's signal handler (it reads server.handle_exit when it starts)."""
        stop_listening = self.server.handle_exit

        def handle_exit(sig: int, frame: Any) -> None:
            # uvicorn: close the listeners and wait for the connections; a second SIGINT there
            # would skip the wait, and the 503s would not be written: it gets the third
            with self._lock:
                self.signals += 1
                nth = self.signals
            if nth != 2:
                stop_listening(sig, frame)
            self.signalled(signal.Signals(sig).name)
        self.server.handle_exit = handle_exit

    def signalled(self, name: str) -> None:
        with self._lock:
            first, self.since = self.since is None, self.since or time.monotonic()
        if not first:
            log.warning("%s again: ending the requests in flight now%s", name,
                        " (a third Ctrl-C stops without waiting for them)" if self.signals == 2 else "")
            self.end_in_flight(f"a second {name} ended it")
            return
        n = self.engine.in_flight
        log.warning("stopping (%s): no new connections; %d request(s) in the engine have %g s to finish, then "
                    "end with 503 %s (a second signal ends them now)", name, n, self.timeout_s, SHUTTING_DOWN)
        threading.Thread(target=self._deadline, name="kvfence-shutdown", daemon=True).start()

    def _deadline(self) -> None:
        # returns early once ended; otherwise the process exits while this waits, if all finished
        if not self._ended.wait(self.timeout_s):
            self.end_in_flight(f"it was still running {self.timeout_s:g} s after the stop began (--shutdown-timeout)")

    def end_in_flight(self, why: str) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
        n = self.engine.end_all(SHUTTING_DOWN, why)
        if n:
            log.warning("stopping: %d request(s) still running after %.1f s ended with 503 %s", n,
                        time.monotonic() - (self.since or time.monotonic()), SHUTTING_DOWN)
