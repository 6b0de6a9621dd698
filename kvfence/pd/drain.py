"""Draining a PD node: take no new request, finish what it has, then exit 0.

Started by the router's authenticated `POST /internal/drain` or by SIGTERM (a second SIGTERM
stops at once, as uvicorn does). While draining the node refuses new prefill and decode
requests with 503 `draining` (the router tries another node) and says `draining` in
/internal/info (the router stops routing to it), but keeps answering release, abort and
stop_pull: a prefill node's held rows wait for decode's pull and ACK, or their lease, before
it may go. It exits once nothing is running, waiting, held for a pull or awaiting one.
Rows still fenced then need not hold it back: once the process is gone a late read finds
no buffer to read (connection refused), and what it did read was sealed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvfence.pd.drain")

# a node's PD counts that mean a request still depends on it
BUSY_PD_COUNTS = ("held", "pending", "awaiting_kv", "waiting_for_pages")
SNAPSHOT_LAG_S = 1.0
DEFAULT_LIMIT_S = 600.0   # a drain still busy this long exits anyway (--shutdown-timeout sets it)


def idle(snapshot: dict) -> bool:
    """Nothing in this node's engine or KV link that a request still needs."""
    pd = snapshot.get("pd") or {}
    return (not snapshot.get("running") and not snapshot.get("waiting")
            and not any(pd.get(k) for k in BUSY_PD_COUNTS))


class Drain:
    def __init__(self, snapshot: Callable[[], dict], exit_now: Callable[[], None], poll_s: float = 0.2,
                 limit_s: float = DEFAULT_LIMIT_S):
        self._snapshot, self._exit, self.poll_s, self.limit_s = snapshot, exit_now, poll_s, limit_s
        self.since: float | None = None
        self.reason = ""
        # prefill/decode streams open on this node: a request accepted just before the drain
        # began may not be in the engine's snapshot yet (changed on the event loop only)
        self.streams = 0
        self.last_stream_end = 0.0   # time.time(): the engine's snapshot must be newer to count
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.since is not None

    def start(self, reason: str) -> bool:
        """Begin draining (idempotent); False if it had begun already."""
        with self._lock:
            if self.since is not None:
                return False
            self.since, self.reason = time.monotonic(), reason
        log.warning("draining (%s): no new requests; exiting once the ones here are done", reason)
        threading.Thread(target=self._wait_then_exit, name="kvfence-drain", daemon=True).start()
        return True

    def stream_ended(self) -> None:
        self.streams -= 1
        self.last_stream_end = time.time()

    def _idle_after_last_stream(self) -> bool:
        # the engine delivers a step's outputs just before it publishes that step's snapshot:
        # a stream that just ended (its request held for a pull) may not be in the snapshot
        # yet. A snapshot published after the stream ended is current; so is any once a
        # second has passed (an idle engine publishes nothing new, and the publish that
        # follows a delivery takes microseconds)
        snap = self._snapshot()
        current = snap.get("published_at", 0.0) > self.last_stream_end or \
            time.time() - self.last_stream_end > SNAPSHOT_LAG_S
        return current and idle(snap)

    def _wait_then_exit(self) -> None:
        assert self.since is not None
        while self.streams or not self._idle_after_last_stream():
            if time.monotonic() - self.since > self.limit_s:
                log.error("drain: still busy after %.0f s; exiting anyway (the router fails what is left)",
                          self.limit_s)
                break
            time.sleep(self.poll_s)
        log.warning("drained in %.1f s: exiting", time.monotonic() - self.since)
        self._exit()
