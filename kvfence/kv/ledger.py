"""The page-ownership ledger: the only way KV pages are granted, written, read and returned.

I1 ownership       every granted page has one owner record (tenant, request, epoch); a free page has none
I2 read check      `authorize()` checks every page of every sequence before each forward pass
I3 watermark       a page's written count says which slots hold this epoch's data; reads stop there
I6 quarantine      a page that may still be touched (or that a violation pointed at) is not reused
I7 scrub           freed pages are left as they are, zeroed, or poisoned, by policy
I9 shared pages    prefix-cache pages are read-only, belong to one cache scope (a tenant, or
                   an opted-in public scope), and are reference-counted; only requests of
                   that scope may attach or read them

State lives in flat numpy arrays so the per-step check is a handful of vector ops.
"""
from __future__ import annotations

import enum
import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

NULL_PAGE = 0  # never granted; padding slots point here and it always holds zeros
# what a tenant (and a public prefix scope) may be called: the tenants file and the PD wire
# both hold names to it, so the scope keys below never collide
TENANT_NAME = r"[A-Za-z0-9_.\-]{1,64}"
# a public prefix scope's cache key: a NUL can't appear in a tenant name taken from a tenants
# file, so scopes never collide with tenants. Names handed out say "public:NAME" instead
# (':' is not allowed in a tenant name either), so no NUL reaches a log, a report or a page.
PUBLIC_SCOPE = "\0public:"


# on a PD node, every scope belongs to the router process that sent its requests: the router
# decides who a tenant name is, and another router (or the same one restarted, which forgets
# its reload history) may give the name to another party. Appended, so the public mark stays first.
ROUTER_REALM = "\0router:"


def scope_name(tenant: str, public_prefix_scope: str | None = None, router: str | None = None) -> str:
    """The one rule for a request's prefix-cache scope key (I9): its tenant's own, or the
    opted-in public scope; behind a router, that router's copy of either, so that no router
    process attaches pages cached for another's tenants of the same name."""
    base = f"{PUBLIC_SCOPE}{public_prefix_scope}" if public_prefix_scope else tenant
    return f"{base}{ROUTER_REALM}{router}" if router else base


def scope_label(name: str) -> str:
    """A tenant's name as it is; a public prefix scope's key as "public:NAME"; without the
    router it is kept for (reports name tenants, not router processes)."""
    name = name.split(ROUTER_REALM, 1)[0]
    return "public:" + name[len(PUBLIC_SCOPE):] if name.startswith(PUBLIC_SCOPE) else name


class PageState(enum.IntEnum):
    FREE = 0
    OWNED = 1
    QUARANTINED = 2
    RESERVED_NULL = 3
    SHARED = 4         # prefix-cache page: read-only, owned by a cache scope, reference-counted


class ScrubPolicy(str, enum.Enum):
    NONE = "none"
    ZERO = "zero"
    POISON = "poison"

    @classmethod
    def parse(cls, value: str | ScrubPolicy) -> ScrubPolicy:
        if isinstance(value, ScrubPolicy):
            return value
        aliases = {"zero-on-free": "zero", "poison-on-free": "poison"}
        try:
            return cls(aliases.get(value, value))
        except ValueError:
            raise ValueError(f"scrub policy must be one of none, zero, poison; got {value!r}") from None


class PoolExhausted(RuntimeError):
    """Not enough free pages for an all-or-nothing grant."""


class LedgerError(RuntimeError):
    """An operation that would break ownership (freeing a page one does not own, ...)."""


@dataclass(frozen=True)
class Owner:
    tenant: int   # tenant id from Ledger.tenant_id()
    request: int  # engine-wide unique request number
    scope: int = -1  # prefix-cache scope (a tenant id); -1: the tenant itself

    @property
    def cache_scope(self) -> int:
        return self.tenant if self.scope < 0 else self.scope


@dataclass
class BlockTable:
    """A request's view of its pages: page ids and the epoch each was granted in."""
    pages: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pages)


@dataclass
class ReadRequest:
    """What one sequence is about to do in a forward pass."""
    owner: Owner
    table: BlockTable
    attend_len: int   # tokens already in the cache that it will attend to
    write_len: int    # new tokens written (and attended) in this pass


@dataclass
class Violation:
    index: int        # position in the list passed to authorize()
    invariant: str    # "I2" or "I3"
    page: int
    detail: str


class Ledger:
    def __init__(self, num_pages: int, page_size: int, scrub: ScrubPolicy | str = ScrubPolicy.NONE,
                 scrubber: Callable[[list[int], ScrubPolicy], None] | None = None):
        if num_pages < 2:
            raise ValueError("a pool needs at least 2 pages (one is the reserved null page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.scrub = ScrubPolicy.parse(scrub)
        self._scrubber = scrubber
        self.state = np.full(num_pages, PageState.FREE, dtype=np.int8)
        self.owner_request = np.full(num_pages, -1, dtype=np.int64)
        self.owner_tenant = np.full(num_pages, -1, dtype=np.int64)
        self.epoch = np.zeros(num_pages, dtype=np.int64)
        self.written = np.zeros(num_pages, dtype=np.int64)
        self.suspect = np.zeros(num_pages, dtype=bool)  # quarantine instead of freeing when returned
        self.refcount = np.zeros(num_pages, dtype=np.int64)  # requests attached to a SHARED page
        self._attached: dict[int, list[int]] = {}  # request -> SHARED pages it holds a reference on
        self._evictable: OrderedDict[int, int] = OrderedDict()  # SHARED, refcount 0, least recent first -> tick
        # the same pages by cache scope: a grant evicts from the scope that holds the most of
        # them, so one tenant's traffic cannot flush another's cached prefixes (global LRU let a
        # busy tenant keep ~96% of the pool); within a scope, least recent first
        self._evictable_of: dict[int, OrderedDict[int, None]] = {}
        # (-pages, first page's tick, scope) per change of a scope's evictable pages; stale
        # entries are skipped when met: picking the scope costs O(log scopes), not a pass over
        # them for each page (1,000 scopes cost ~0.2 ms a page, found in review)
        self._scope_heap: list[tuple[int, int, int]] = []
        self._tick = 0
        self._retiring: set[int] = set()   # SHARED pages of a retired scope: freed when their last reader ends
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets the page
        self.on_time_lift: Callable[[int, list[int]], None] | None = None  # a fence ends by time (incident log)
        self.state[NULL_PAGE] = PageState.RESERVED_NULL
        self._free: deque[int] = deque(range(num_pages - 1, 0, -1))
        self._tenants: dict[str, int] = {}   # name -> its current id
        self._names: dict[int, str] = {}     # every id given and still referenced -> its name
        self._next_id = 0                    # ids are never reused, even once pruned
        self._retired: set[int] = set()      # ids of retired cache scopes: never published to again
        # I6 fences: request -> (its quarantined pages, time after which nothing can touch
        # them, or None: only an explicit proof lifts it). The owner tag of a quarantine.
        self._fences: dict[int, tuple[list[int], float | None]] = {}
        self.counters: Counter[str] = Counter()
        self.violations: Counter[str] = Counter()  # by invariant
        self.checks_enabled = True  # off only for the bench's on/off comparison and its tests

    # -- tenants ------------------------------------------------------------------------
    def tenant_id(self, name: str) -> int:
        got = self._tenants.get(name)
        if got is None:   # ids only grow: a retired name comes back under a new one
            got = self._tenants[name] = self._next_id
            self._next_id += 1
            self._names[got] = name
        return got

    def tenant_name(self, tenant: int) -> str | None:
        """The name behind a tenant or cache-scope id (None for -1: nobody); a public scope
        as "public:NAME" (scope_label)."""
        name = self._names.get(tenant)
        return None if name is None else scope_label(name)

    def page_owner(self, page: int) -> str | None:
        """Whose data the page holds at this moment, by name: the owning request's tenant, a
        shared page's cache scope; None for a free page."""
        owner = self.page_owner_id(page)
        return None if owner is None else self.tenant_name(owner)

    def page_owner_id(self, page: int) -> int | None:
        if self.state[page] not in (PageState.OWNED, PageState.SHARED, PageState.QUARANTINED):
            return None
        return int(self.owner_tenant[page])

    def same_name_other_party(self, a: int, b: int) -> bool:
        """Two tenant or scope ids that reports would name alike but that are not the same
        party's: a retired name and its successor, or on a PD node two routers' tenants of one
        name. A report keyed by name must not take one's data for the other's own."""
        return a != b and self.tenant_name(a) == self.tenant_name(b)

    # -- capacity -----------------------------------------------------------------------
    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.usable_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages a grant can get: free ones plus unreferenced prefix-cache pages it may evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_shared(self) -> int:
        return int((self.state == PageState.SHARED).sum())

    @property
    def num_quarantined(self) -> int:
        return int((self.state == PageState.QUARANTINED).sum())

    @property
    def num_owned(self) -> int:
        return int((self.state == PageState.OWNED).sum())

    @property
    def num_fenced(self) -> int:
        """Quarantined pages under an I6 fence (a remote party may still touch them)."""
        pages = [p for ps, _ in self._fences.values() for p in ps]
        return int((self.state[pages] == PageState.QUARANTINED).sum()) if pages else 0

    def pages_by_owner(self) -> dict[str, dict[str, int]]:
        """Counts only, by name: pages owned by running requests per tenant, and read-only
        prefix-cache pages per cache scope (the operator console's pool map). Two vector
        passes over the ledger; the names come from the few distinct ids."""
        out: dict[str, dict[str, int]] = {}
        for state, key in ((PageState.OWNED, "owned"), (PageState.SHARED, "shared")):
            ids, counts = np.unique(self.owner_tenant[self.state == state], return_counts=True)
            named: dict[str, int] = {}
            for i, c in zip(ids, counts, strict=True):   # a retired id and its successor share a name
                name = self.tenant_name(int(i)) or "?"
                named[name] = named.get(name, 0) + int(c)
            out[key] = named
        return out

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- grant and return (I1) ----------------------------------------------------------
    def allocate(self, owner: Owner, n: int, table: BlockTable) -> None:
        """Grant n pages to owner, appended to table; all or nothing."""
        if n <= 0:
            return
        if n > self.num_available:
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free and {len(self._evictable)} evictable")
        while n > len(self._free):
            self._evict_one()
        for _ in range(n):
            p = self._free.pop()  # most recently freed first: warm in cache
            if self.state[p] != PageState.FREE or self.owner_request[p] != -1:
                raise LedgerError(f"page {p} on the free list is not free")  # corrupted free list
            self.state[p] = PageState.OWNED
            self.owner_request[p] = owner.request
            self.owner_tenant[p] = owner.tenant
            self.written[p] = 0
            table.pages.append(p)
            table.epochs.append(int(self.epoch[p]))
        if self.scrub is ScrubPolicy.POISON and self._scrubber is not None:
            # poison marks freed pages; a granted page starts clean, or its not-yet-written
            # slots (masked out, but 0 x NaN is NaN in attention) would poison its owner
            self._scrubber(table.pages[-n:], ScrubPolicy.ZERO)
        self.counters["pages_allocated"] += n

    def free(self, owner: Owner, table: BlockTable) -> None:
        """Return every page the ledger says owner holds, whatever its block table says (a
        corrupted table must not leak pages). The epoch moves on so stale references never
        match again. Pages marked suspect go to quarantine instead."""
        mine = self._pages_of(owner)
        suspect = self.suspect[mine]
        for p in mine[suspect]:
            self._quarantine_page(int(p))
        self._release(mine[~suspect].tolist())
        self._detach_all(owner)
        table.pages.clear()
        table.epochs.clear()

    def _pages_of(self, owner: Owner) -> np.ndarray:
        return np.flatnonzero((self.owner_request == owner.request) & (self.state == PageState.OWNED))

    # -- shared prefix pages (I9) ---------------------------------------------------------
    def publish(self, owner: Owner, page: int, epoch: int) -> bool:
        """Turn a fully written page that owner owns into a read-only SHARED page of owner's
        cache scope. Owner keeps a reference until it is freed."""
        if not self._owns(owner, page, epoch) or self.written[page] != self.page_size or self.suspect[page] \
                or owner.cache_scope in self._retired:   # a request that outlived its tenant's removal
            return False
        self.state[page] = PageState.SHARED
        self.owner_request[page] = -1
        self.owner_tenant[page] = owner.cache_scope
        self.refcount[page] = 1
        self._attached.setdefault(owner.request, []).append(page)
        self.counters["pages_published"] += 1
        return True

    def attach(self, owner: Owner, page: int, table: BlockTable) -> bool:
        """Give owner a read reference on a SHARED page of its own cache scope."""
        if self.state[page] != PageState.SHARED or self.owner_tenant[page] != owner.cache_scope \
                or page in self._retiring:
            return False
        self.refcount[page] += 1
        self._not_evictable(page)
        self._attached.setdefault(owner.request, []).append(page)
        table.pages.append(page)
        table.epochs.append(int(self.epoch[page]))
        self.counters["pages_attached"] += 1
        return True

    def _detach_all(self, owner: Owner) -> None:
        # last page first: it becomes the least recent of them, so eviction takes a chain's
        # tail before its head (a head evicted first would leave the rest unmatchable)
        for p in reversed(self._attached.pop(owner.request, [])):
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if self.suspect[p]:
                    self._forget(p)
                    self._retiring.discard(p)
                    self._quarantine_page(p)
                elif p in self._retiring:
                    self._evict(p)
                else:
                    self._now_evictable(p)

    def _forget(self, page: int) -> None:
        if self.on_evict is not None:
            self.on_evict(page)
        self._not_evictable(page)

    def _now_evictable(self, page: int) -> None:
        self._tick += 1
        self._evictable[page] = self._tick   # most recently used last
        scope = int(self.owner_tenant[page])
        self._evictable_of.setdefault(scope, OrderedDict())[page] = None
        self._note_scope(scope)

    def _not_evictable(self, page: int) -> None:
        if self._evictable.pop(page, None) is None:
            return
        scope = int(self.owner_tenant[page])
        mine = self._evictable_of[scope]
        del mine[page]
        if not mine:
            del self._evictable_of[scope]
        self._note_scope(scope)

    def _scope_entry(self, scope: int) -> tuple[int, int, int] | None:
        mine = self._evictable_of.get(scope)
        return None if not mine else (-len(mine), self._evictable[next(iter(mine))], scope)

    def _note_scope(self, scope: int) -> None:
        entry = self._scope_entry(scope)
        if entry is not None:
            heapq.heappush(self._scope_heap, entry)
        if len(self._scope_heap) > 4 * len(self._evictable_of) + 64:   # mostly stale: start again
            self._scope_heap = [e for s in self._evictable_of if (e := self._scope_entry(s)) is not None]
            heapq.heapify(self._scope_heap)

    def _evict_one(self) -> None:
        # the scope with the most unreferenced cached pages gives one up, its least recent;
        # between scopes that hold as many, the one whose page was used longest ago
        while self._scope_heap[0] != self._scope_entry(self._scope_heap[0][2]):
            heapq.heappop(self._scope_heap)
        self._evict(next(iter(self._evictable_of[self._scope_heap[0][2]])))

    def _evict(self, page: int) -> None:
        self._forget(page)
        self._retiring.discard(page)
        self.refcount[page] = 0
        self._release([page])
        self.counters["pages_evicted"] += 1

    def retire_realm(self, router: str) -> int:
        """Retire every cache scope of that router process (ledger.scope_name): its tenants'
        own and their public ones, as retire_scope does each. Returns the pages."""
        suffix = f"{ROUTER_REALM}{router}"
        return sum(self.retire_scope(n) for n in [n for n in self._tenants if n.endswith(suffix)])

    def prune_names(self, live: set[int]) -> int:
        """Forget the names of retired ids that nothing refers to any more: no page (owned,
        shared or quarantined) and no request in `live` (the ids of every request the engine
        holds). Each router process a PD node served leaves its names behind once retired; this
        keeps the tables to what is in use. Returns how many were dropped."""
        current = set(self._tenants.values())
        held = set(np.unique(self.owner_tenant[self.state != PageState.FREE]).tolist())
        gone = [i for i in self._names if i not in current and i not in held and i not in live]
        for i in gone:
            del self._names[i]
            self._retired.discard(i)
        return len(gone)

    def retire_scope(self, name: str) -> int:
        """A tenant is gone (a tenants-file reload removed it): its cached prefix pages leave
        the cache now, so a tenant given the name later cannot attach or time them. Pages no
        request reads are scrubbed and freed at once, the others when their last reader ends.
        The scope's id is retired with them: a request of the old tenant still running
        publishes nothing more under it, and the name comes back under a new id, which
        attaches none of the old one's pages. Returns how many pages were retired."""
        scope = self._tenants.pop(name, None)
        if scope is None:
            return 0
        self._retired.add(scope)
        pages = np.flatnonzero((self.state == PageState.SHARED) & (self.owner_tenant == scope))
        for p in (int(p) for p in pages):
            if self.refcount[p] == 0:
                self._evict(p)
            else:
                self._forget(p)   # no longer found by the prefix cache
                self._retiring.add(p)
        self.counters["pages_retired"] += len(pages)
        return len(pages)

    def _owns(self, owner: Owner, page: int, epoch: int) -> bool:
        return (self.state[page] == PageState.OWNED and self.owner_request[page] == owner.request
                and self.epoch[page] == epoch)

    def _release(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.scrub is not ScrubPolicy.NONE and self._scrubber is not None:
            self._scrubber(pages, self.scrub)
        self._retire(np.asarray(pages, dtype=np.int64), PageState.FREE)
        self._free.extend(pages)
        self.counters["pages_freed"] += len(pages)

    def _retire(self, idx: np.ndarray | int, state: PageState) -> None:
        """End the current owner record: no owner, nothing written, a new epoch."""
        self.state[idx] = state
        self.owner_request[idx] = -1
        self.owner_tenant[idx] = -1
        self.written[idx] = 0
        self.epoch[idx] += 1
        self.suspect[idx] = False
        self.refcount[idx] = 0

    # -- quarantine (I6) ----------------------------------------------------------------
    def quarantine(self, pages: Iterable[int], reason: str) -> None:
        """Take pages out of circulation. A page still owned by someone else stays with its
        owner (its data is intact) and is quarantined when returned."""
        for p in set(int(p) for p in pages):
            if p == NULL_PAGE or not (0 <= p < self.num_pages):
                continue
            if self.state[p] == PageState.SHARED:
                self._forget(p)  # never handed to another request again
                if self.refcount[p] == 0:
                    self._quarantine_page(p)
                else:
                    self.suspect[p] = True
            elif self.state[p] == PageState.OWNED:
                self.suspect[p] = True
            elif self.state[p] == PageState.FREE:
                self._free.remove(p)
                self._quarantine_page(p)
        self.counters[f"quarantine:{reason}"] += 1

    def _quarantine_page(self, p: int) -> None:
        self._retire(p, PageState.QUARANTINED)
        self.counters["pages_quarantined"] += 1

    def fence(self, owner: Owner, table: BlockTable, reason: str, until: float | None = None) -> list[int]:
        """Quarantine every page owner holds because a remote party may still read or write
        them (I6), remembering whose they were and until when the danger lasts: `until` is
        a time.time() after which no transfer can touch them, None if only `lift_fence`
        (the writer confirmed it stopped) may release them."""
        pages = [int(p) for p in self._pages_of(owner)]
        for p in pages:
            self._quarantine_page(p)
        self._detach_all(owner)
        table.pages.clear()
        table.epochs.clear()
        if pages:
            old, old_until = self._fences.get(owner.request, ([], until))
            self._fences[owner.request] = (old + pages, until if old_until is None or until is None
                                           else max(until, old_until))
        self.counters[f"fence:{reason}"] += 1
        return pages

    def fenced(self, request: int) -> bool:
        return request in self._fences

    @property
    def num_fences(self) -> int:
        return len(self._fences)

    def lift_fence(self, request: int) -> int:
        """The remote party confirmed it stopped: free the request's fenced pages."""
        pages, _ = self._fences.pop(request, ([], None))
        self.release_quarantine(pages)
        return len(pages)

    def lift_expired_fences(self, now: float) -> int:
        """Free the pages of every fence whose time has passed (on_time_lift hears of each:
        these were freed on a clock, not on proof that nothing touches them)."""
        done = [(r, pages) for r, (pages, until) in self._fences.items() if until is not None and until <= now]
        for r, pages in done:
            if self.on_time_lift is not None:
                self.on_time_lift(r, list(pages))
        return sum(self.lift_fence(r) for r, _ in done)

    def next_fence_time(self) -> float | None:
        times = [u for _, u in self._fences.values() if u is not None]
        return min(times) if times else None

    def release_quarantine(self, pages: Iterable[int]) -> None:
        """A fence proved nothing can touch these pages any more: scrub and free them."""
        ps = [int(p) for p in pages if self.state[int(p)] == PageState.QUARANTINED]
        self._release(ps)

    # -- writes (I3) --------------------------------------------------------------------
    def mark_written(self, owner: Owner, table: BlockTable, start: int, end: int) -> None:
        """Record that owner wrote token slots start .. end-1 (contiguous from the watermark)."""
        ps = self.page_size
        for i in range(start // ps, self.pages_for(end)):
            p, e = table.pages[i], table.epochs[i]
            if not self._owns(owner, p, e):
                raise LedgerError(f"request {owner.request} wrote page {p} it does not own")
            self.written[p] = max(int(self.written[p]), min(ps, end - i * ps))

    # -- the per-step check (I2, I3) ----------------------------------------------------
    def authorize(self, reads: Sequence[ReadRequest]) -> list[Violation]:
        """Check, for every sequence, every page it will read or write in this pass: owned
        by it in the granted epoch, or a read-only SHARED page of its cache scope in that
        epoch that it does not write (I2, I9); and every slot it attends from the cache
        already written in this epoch (I3). Returns one violation per failing sequence."""
        from kvfence import faults  # test-only fault points; a no-op unless a test enables them

        if not reads or not self.checks_enabled or faults.active("skip_ledger_check"):
            return []
        ps = self.page_size
        counts = np.fromiter((self.pages_for(r.attend_len + r.write_len) for r in reads), np.int64, len(reads))
        short = [i for i, (r, c) in enumerate(zip(reads, counts)) if len(r.table) < c]
        out = [Violation(i, "I2", NULL_PAGE, f"block table has {len(reads[i].table)} pages, needs {counts[i]}")
               for i in short]
        total = int(counts.sum())
        pages = np.empty(total, np.int64)
        epochs = np.empty(total, np.int64)
        req = np.empty(total, np.int64)
        scope = np.empty(total, np.int64)
        writes = np.empty(total, bool)
        need = np.empty(total, np.int64)
        seq = np.repeat(np.arange(len(reads)), counts)
        pos = 0
        for r, c in zip(reads, counts):
            c = int(c)
            if len(r.table) >= c:
                pages[pos:pos + c] = r.table.pages[:c]
                epochs[pos:pos + c] = r.table.epochs[:c]
            else:  # reported above; check what is there against an impossible page
                pages[pos:pos + c] = NULL_PAGE
                epochs[pos:pos + c] = -1
            req[pos:pos + c] = r.owner.request
            scope[pos:pos + c] = r.owner.cache_scope
            idx = np.arange(c)
            writes[pos:pos + c] = idx >= r.attend_len // ps  # pages this pass writes into
            # slots of page i that must already hold data: the attended cache part
            need[pos:pos + c] = np.clip(r.attend_len - idx * ps, 0, ps)
            pos += c
        state = self.state[pages]
        same_epoch = self.epoch[pages] == epochs
        own = (state == PageState.OWNED) & (self.owner_request[pages] == req) & same_epoch
        read_only = ~writes if not faults.active("write_shared_page") else np.ones_like(writes)
        shared = (state == PageState.SHARED) & (self.owner_tenant[pages] == scope) & same_epoch & read_only
        bad_owner = ~(own | shared)
        bad_written = ~bad_owner & (self.written[pages] < need)
        if faults.active("skip_watermark"):
            bad_written[:] = False
        seen = {v.index for v in out}
        for kind, mask in (("I2", bad_owner), ("I3", bad_written)):
            for j in np.flatnonzero(mask):
                i = int(seq[j])
                if i in seen:
                    continue
                seen.add(i)
                p = int(pages[j])
                if kind == "I2":
                    detail = (f"page {p} is {PageState(int(self.state[p])).name.lower()} "
                              f"(owner request {self.owner_request[p]}, scope {self.owner_tenant[p]}, "
                              f"epoch {self.epoch[p]}), block table says request {req[j]}, epoch {epochs[j]}"
                              + (", and this pass would write it" if writes[j] else ""))
                else:
                    detail = f"page {p} has {self.written[p]} written slots, attention needs {need[j]}"
                out.append(Violation(i, kind, p, detail))
        for v in out:
            self.violations[v.invariant] += 1
        return out

    # -- invariant audit, for tests ------------------------------------------------------
    def check_consistency(self) -> None:
        """Raise if the ledger's own records disagree (I1): used by tests after every step."""
        if self.state[NULL_PAGE] != PageState.RESERVED_NULL:
            raise LedgerError("the null page lost its reserved state")
        free = set(self._free)
        if len(free) != len(self._free):
            raise LedgerError("a page is on the free list twice")
        by_scope = {p: scope for scope, ps in self._evictable_of.items() for p in ps}
        if by_scope.keys() != self._evictable.keys() or any(not ps for ps in self._evictable_of.values()) \
                or any(self.owner_tenant[p] != scope for p, scope in by_scope.items()):
            raise LedgerError("the evictable pages by cache scope disagree with the evictable list")
        entries = set(self._scope_heap)
        if any(self._scope_entry(s) not in entries for s in self._evictable_of):
            raise LedgerError("a cache scope with evictable pages has no current entry to be picked by")
        for p in range(1, self.num_pages):
            st = self.state[p]
            if (p in free) != (st == PageState.FREE):
                raise LedgerError(f"page {p}: state {PageState(int(st)).name} but on free list: {p in free}")
            if (st == PageState.SHARED) != (p in self._evictable or self.refcount[p] > 0):
                raise LedgerError(f"page {p}: shared={st == PageState.SHARED} but refcount {self.refcount[p]}")
            if p in self._retiring and not (st == PageState.SHARED and self.refcount[p] > 0
                                            and p not in self._evictable):
                raise LedgerError(f"page {p} is retiring but not a shared page that a request still reads")
            if st != PageState.OWNED and self.owner_request[p] != -1:
                raise LedgerError(f"page {p} is {PageState(int(st)).name} yet has an owner")
            if st == PageState.OWNED and self.owner_request[p] < 0:
                raise LedgerError(f"page {p} is owned by nobody")
