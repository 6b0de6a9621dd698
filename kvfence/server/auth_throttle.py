"""Failed operator sign-ins, counted per client address.

The operator key opens the console: every tenant's name, the fleet, the incident log. A
wrong key costs an attacker one request, so without a bound a client may guess as fast as
the server answers. After LIMIT failures from one address within WINDOW_S, that address
gets 429 with Retry-After on the operator routes until its window ends, and the key it
sends is not even checked (a right guess then looks like a wrong one). Tenant routes are not
throttled here: behind a shared proxy address one guesser would lock every tenant out of
inference, where here it locks out only sign-ins through that proxy.

One table counts every check of the operator's and the scraper's keys (the console, /metrics,
/health's detail, the isolation statement): with one table each, a guesser got each route's
limit. An IPv6 client counts by its /64, the block one host is usually given: per exact address
one host could guess without bound.

The table is bounded (MAX_ADDRESSES), so many addresses cost memory that is bounded too. When
it is full, an ended window goes first, then the oldest still under the limit, and a held-back
address only when every other one is held back too: else a guesser could lift its own hold by
failing once from each of MAX_ADDRESSES other addresses. Called from the event loop only (no
lock): the console's handlers check and count without awaiting in between.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfence.server.http_limits import address_group

if TYPE_CHECKING:
    from starlette.requests import Request

LIMIT = 30          # failures per address and window: a person mistyping never reaches it
WINDOW_S = 60.0
MAX_ADDRESSES = 4096


def client_address(request: Request) -> str:
    """The peer's address as the socket gives it, or, from a --trusted-proxy, the client's that
    the proxy forwarded (http_limits.py: without one, X-Forwarded-For is ignored)."""
    return request.client.host if request.client else "unknown"


class FailedAuthThrottle:
    def __init__(self, limit: int = LIMIT, window_s: float = WINDOW_S, max_addresses: int = MAX_ADDRESSES,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.max_addresses, self.clock = limit, window_s, max_addresses, clock
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()   # address -> (start, failures)

    def _current(self, group: str) -> tuple[float, int] | None:
        window = self._windows.get(group)
        if window is not None and self.clock() - window[0] >= self.window_s:
            del self._windows[group]
            return None
        return window

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again, or None if it may now."""
        window = self._current(address_group(address))
        if window is None or window[1] < self.limit:
            return None
        return max(1, math.ceil(window[0] + self.window_s - self.clock()))

    def failed(self, address: str) -> None:
        group = address_group(address)
        window = self._current(group)
        start, count = window if window is not None else (self.clock(), 0)
        self._windows[group] = (start, count + 1)
        self._windows.move_to_end(group)
        if len(self._windows) > self.max_addresses:
            self._make_room(keep=group)

    def _make_room(self, keep: str) -> None:
        now = self.clock()
        for g in [g for g, (start, _) in self._windows.items() if now - start >= self.window_s]:
            del self._windows[g]
        while len(self._windows) > self.max_addresses:
            victim = next((g for g, (_, n) in self._windows.items() if n < self.limit and g != keep), None)
            if victim is None:    # every other address is held back: the one that failed least recently goes
                victim = next(g for g in self._windows if g != keep)
            del self._windows[victim]
