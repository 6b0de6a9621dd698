"""Tenant-scoped prefix cache (I9): reuse the KV pages of a prompt prefix computed before.

A full page is identified by a hash chain over (cache scope, previous page's hash, the
page's token ids). The scope is the tenant unless the request opted into a declared public
scope, so a tenant can only ever hit pages computed for its own scope: no cross-tenant
sharing, and another tenant's prompt cannot be probed by timing (what the shared pool's eviction
still shows is volume, not content: docs/isolation.md). The ledger holds the pages (SHARED state,
reference counts, eviction); this module only maps hashes to pages.
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvfence.kv.ledger import BlockTable, Ledger, Owner


def page_hashes(scope: str, tokens: list[int], page_size: int, n_pages: int) -> list[bytes]:
    out, parent = [], hashlib.blake2b(scope.encode(), digest_size=16).digest()
    arr = np.asarray(tokens[: n_pages * page_size], dtype=np.int64)
    for i in range(n_pages):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[i * page_size:(i + 1) * page_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        ledger.on_evict = self._forget
        self.hits = 0      # tokens served from the cache
        self.lookups = 0   # tokens looked up

    def __len__(self) -> int:
        return len(self._page_of)

    def match(self, owner: Owner, scope: str, tokens: list[int], table: BlockTable) -> int:
        """Attach the longest cached prefix of tokens (whole pages, leaving at least one
        token to compute) to table; returns the number of tokens it covers."""
        ps = self.ledger.page_size
        n = (len(tokens) - 1) // ps
        matched = 0
        for h in page_hashes(scope, tokens, ps, n):
            page = self._page_of.get(h)
            if page is None or not self.ledger.attach(owner, page, table):
                break
            matched += ps
        self.lookups += n * ps
        self.hits += matched
        return matched

    def unmatch(self, tokens: list[int], matched: int) -> None:
        """The scheduler let go of a match (the request did not fit this step and looks again
        later): its lookup and hits must not count once per step it waits (found in review)."""
        ps = self.ledger.page_size
        self.lookups -= (len(tokens) - 1) // ps * ps
        self.hits -= matched

    def publish(self, owner: Owner, scope: str, tokens: list[int], table: BlockTable, computed: int) -> int:
        """Offer owner's fully written pages to the cache; returns how many became shared."""
        ps = self.ledger.page_size
        n = min(computed // ps, len(table))
        added = 0
        for i, h in enumerate(page_hashes(scope, tokens, ps, n)):
            if h in self._page_of:
                continue  # already cached (this page may be that very one, attached earlier)
            page, epoch = table.pages[i], table.epochs[i]
            if self.ledger.publish(owner, page, epoch):
                self._page_of[h] = page
                self._hash_of[page] = h
                added += 1
        return added

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None:
            self._page_of.pop(h, None)
