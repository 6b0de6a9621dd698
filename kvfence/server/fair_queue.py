"""One worker thread that runs calls one at a time, the keys (tenants) taking turns.

A plain single-thread executor runs calls in arrival order: a tenant with many slow calls
waiting (structured-output schemas that each take up to the checker's deadline) delays every
later tenant by all of them. Here each key has its own queue and the keys are served round
robin; a key whose call is running rejoins the rotation behind the keys that waited meanwhile,
so a call waits at most for the one running and one of each other key with calls waiting.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Call = tuple[Callable[[], Any], Future]


class FairWorker:
    def __init__(self, name: str):
        self.name = name
        self._queues: OrderedDict[str, deque[_Call]] = OrderedDict()   # keys in turn order
        self._running: str | None = None      # its calls wait in _held until its call ends
        self._held: deque[_Call] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: str, fn: Callable[[], Any]) -> Future:
        """fn() run on the worker in key's turn; a future cancelled before its turn is skipped."""
        fut: Future = Future()
        with self._cv:
            if self._thread is None:
                # kept only once it runs: a start that failed (no threads left) is tried again
                # by the next call, not taken as a worker that never takes anything
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                thread.start()
                self._thread = thread
            if key == self._running:
                self._held.append((fn, fut))
            else:
                self._queues.setdefault(key, deque()).append((fn, fut))
            self._cv.notify()
        return fut

    def waiting(self) -> dict[str, int]:
        """Calls not yet started, by key (for tests and the log)."""
        with self._cv:
            out = {k: len(q) for k, q in self._queues.items()}
            if self._running is not None and self._held:
                out[self._running] = len(self._held)
            return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queues:
                    self._cv.wait()
                key, queue = self._queues.popitem(last=False)
                fn, fut = queue.popleft()
                self._running, self._held = key, queue
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the caller's to see, not the worker's end
                        fut.set_exception(e)
            finally:
                with self._cv:
                    if self._held:
                        self._queues[key] = self._held   # behind every key that waited meanwhile
                    self._running, self._held = None, deque()
