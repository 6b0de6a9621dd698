"""How many lines one key (a tenant) may add to the server log per window.

Each refused request of a known tenant is logged, so that "my requests get 400" can be
looked up by request id. A client looping on a refused request (a wrong model name, its
rate limit) would otherwise write a line per request for as long as it loops. Past the
budget its lines are counted, not written, and the next line written says how many were
left out. Keys are bounded (MAX_KEYS, the least recently used dropped first).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

PER_WINDOW = 20
WINDOW_S = 10.0
MAX_KEYS = 4096


class LogBudget:
    def __init__(self, per_window: int = PER_WINDOW, window_s: float = WINDOW_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        self.per_window, self.window_s, self.max_keys, self.clock = per_window, window_s, max_keys, clock
        self._windows: OrderedDict[str, list] = OrderedDict()   # key -> [start, written, left out]

    def take(self, key: str) -> int | None:
        """None: leave this line out. Else write it, saying the returned number of this key's
        lines left out before it (0: none)."""
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            w = [now, 0, w[2] if w is not None else 0]
            self._windows[key] = w
        self._windows.move_to_end(key)
        while len(self._windows) > self.max_keys:
            self._windows.popitem(last=False)
        if w[1] >= self.per_window:
            w[2] += 1
            return None
        w[1] += 1
        left_out, w[2] = w[2], 0
        return left_out
