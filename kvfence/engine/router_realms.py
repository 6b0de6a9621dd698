"""Which router processes a PD node holds cache scopes for, and when to let them go.

A node keeps each router process's tenants in their own cache scopes (ledger.scope_name), so
a restarted router, whose process id is new, leaves its predecessor's scopes behind: nothing
can attach them any more, but their pages stay until the cache evicts them, and their names
stay in the ledger. A router that has sent this node no request and no message for `idle_s`
is taken for gone: its scopes are retired (pages scrubbed and freed as a tenants-file reload
does), its names pruned. One that was only quiet loses its cached prefixes, nothing else: its
scope generations (pd/scope_epochs.py) are kept apart from this, so a request stamped before
a reload is still refused after it.
"""
from __future__ import annotations

DEFAULT_IDLE_S = 600.0


class RouterRealms:
    def __init__(self, idle_s: float = DEFAULT_IDLE_S):
        if not 0 < idle_s < float("inf"):
            raise ValueError(f"the router scope idle time must be a positive number of seconds; got {idle_s!r}")
        self.idle_s = idle_s
        self._seen: dict[str, float] = {}   # router -> when it last sent anything; oldest first

    def seen(self, router: str, now: float) -> None:
        self._seen.pop(router, None)   # re-inserted last: the dict stays ordered by last use
        self._seen[router] = now

    def next_due(self) -> float | None:
        """When the least recently seen router becomes idle (on the clock `seen` was given), or None."""
        for when in self._seen.values():
            return when + self.idle_s
        return None

    def due(self, now: float) -> list[str]:
        """The routers idle since `idle_s`, forgotten here: the caller retires their scopes."""
        gone = []
        for router, when in self._seen.items():
            if now - when < self.idle_s:
                break
            gone.append(router)
        for router in gone:
            del self._seen[router]
        return gone

    def __len__(self) -> int:
        return len(self._seen)
