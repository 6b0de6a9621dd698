"""Decode side of a handoff: reserve, pull, verify (I5), and only then decode.

A request arrives with the manifest prefill returned. Its static checks run before
anything is reserved (`check_manifest`: this request, this tenant, the token count the
router asked for, this model and layout). Then, when pool pages and transfer-buffer rows
are free, RESERVE takes pool pages for the prompt and its first `decode_reserve_tokens`
generated tokens, and rows for the pull, and the pull starts, but only while the lease has
more than the clock skew left. The pull writes the rows, never pool pages. Waiting requests
are reserved by need and tenant share, not strictly first in, first out (`_pick`).

Once verified, a request grows page by page as it generates, like on a single node. If the
pool runs out, the newest request of the tenant running the most is preempted: its pages go
back through the ledger and decode recomputes its KV (prompt and generated tokens) when pages return, so
it goes on with the same tokens; it never reads a page it does not own. Only a request that
cannot fit even alone ends, with kv_pool_exhausted (the router's start-up check, I8, makes
that impossible for any request it admits).

A pull's completion notice names its pull id; a notice for a pull that is not the
request's live pull (duplicated, late, after an abort) changes nothing but the fence of
that pull's own rows. On success every row is checked (`verify_pages`: header names this
request, tenant, prefill process and epoch; checksum), copied into the pool pages, the
written watermark set to the verified token count (I3), and VERIFY makes the request
runnable. A failed check or transfer aborts it. Rows of a pull still in flight when the
request ends stay fenced until the notice comes or max_pull_s has passed (I6).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvfence import faults, incidents
from kvfence.engine.kv_link import Decision, EndRequest, KvArrived, Reserve, contained
from kvfence.engine.request_states import Event
from kvfence.engine.sequence import Sequence
from kvfence.kv.ledger import BlockTable, Owner
from kvfence.pd.link import PdLink
from kvfence.pd.manifest import ManifestError, check_manifest, parse_handoff
from kvfence.pd.messages import Handoff, Manifest
from kvfence.pd.prefill import kill_point, next_by_share
from kvfence.pd.seal import SealError
from kvfence.pd.settings import PDSettings

# request ids the router gave up on (stop_pull) remembered at once; past this, stop_pull
# answers "a read may run" for an id it cannot remember (prefill then fences: safe)
GIVEN_UP_MAX = 65536

log = logging.getLogger("kvfence.pd.decode")


def _handoff(seq: Sequence) -> Handoff:
    if seq.kv_source is None:  # the engine admits a decode request only with its handoff
        raise RuntimeError(f"request {seq.request_id} has no KV handoff")
    return seq.kv_source


def _request_of(seq: Sequence) -> tuple[str, str]:
    """The client request seq is a choice of, within its tenant (a router names it by its first
    choice's id; one from before that, or a single choice: its own)."""
    h = seq.kv_source
    return seq.tenant, (h.choice_of if isinstance(h, Handoff) and h.choice_of else seq.request_id)


def _manifest(seq: Sequence) -> Manifest:
    return _handoff(seq).manifest


@dataclass
class Pull:
    pull_id: int
    seq: Sequence
    owner: Owner        # the rows' owner record in the transfer buffer's ledger
    rows: BlockTable
    started: float                  # queued (decode's clock): the give-up timer runs from here
    # guarded by KvImporter._lock (the worker thread and the engine thread both look):
    read_at: float | None = None    # the worker began the one-sided read: the fence runs from here
    cancelled: bool = False         # given up before its read began: the read never begins


class KvImporter(PdLink):
    def __init__(self, engine, settings: PDSettings, transport, workers: int = 4):
        super().__init__(engine, settings, transport)
        self.waiting: deque[Sequence] = deque()      # admitted, waiting for pages and rows (arrival order)
        self._bypassed: Counter[str] = Counter()     # request id -> reservations made past it while it waited
        # (tenant, client request) -> [when its first choice arrived here, its choices here]: see _pick
        self._requests: dict[tuple[str, str], list] = {}
        self.pulls: dict[int, Pull] = {}             # every pull whose notice has not come
        self.live: dict[str, int] = {}               # request id -> its pull, while AWAITING_KV
        self.notices: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="kvfence-pull")
        self._lock = threading.Lock()   # Pull.read_at / Pull.cancelled: begin_read vs on_end
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0
        self.open_seconds = 0.0      # authenticating, decrypting and unstaging pulled rows
        # request id -> until when it is refused (engine thread): see stop_pull
        self._given_up: OrderedDict[str, float] = OrderedDict()
        self._unknown_keys: set[str] = set()   # key ids of refused handoffs, already logged

    # -- admission (engine thread) -------------------------------------------------------------
    def check(self, seq: Sequence, handoff: object) -> Handoff:
        """Static checks of the handoff, before the request is admitted (raises ManifestError);
        returns the handoff the request will pull by."""
        given_up = self._given_up.get(seq.request_id)
        if given_up is not None and given_up > time.monotonic():
            raise ManifestError(f"request {seq.request_id}: the router gave up on it before it reached this node")
        h = parse_handoff(handoff)
        eng = self.engine
        if not faults.active("skip_manifest_check"):
            check_manifest(h, request_id=seq.request_id, tenant=seq.tenant,
                           token_count=len(seq.prompt_ids) - 1,
                           page_size=eng.ledger.page_size, fingerprint=eng.model_config.fingerprint(),
                           layout=self.staging.layout, slot_bytes=self.staging.slot_bytes)
        if self.sealing_secret(h.manifest) is None:   # a rotation half done: refused before any pull
            key = h.manifest.seal_key or ""
            if key not in self._unknown_keys and len(self._unknown_keys) < 16:   # the operator's: said once a key
                self._unknown_keys.add(key)
                log.warning("handoffs sealed under cluster secret key id %s are refused: this decode node does not "
                            "hold that secret (give it with --accept-cluster-secret-file; docs/pd.md, rotating)",
                            key)
            raise ManifestError(f"the rows are sealed under a cluster secret (key id {h.manifest.seal_key}) this "
                                "decode node does not hold: while rotating, give every node the new secret with "
                                "--accept-cluster-secret-file before any node seals with it (docs/pd.md)")
        return h

    def enqueue(self, seq: Sequence, now: float) -> Iterator[Decision]:
        self.waiting.append(seq)
        entry = self._requests.setdefault(_request_of(seq), [seq.arrival, 0])
        entry[1] += 1
        yield from self._reserve_waiting(now)

    def _age(self, seq: Sequence) -> tuple[float, float]:
        """seq's place in arrival order: when the first choice of its prompt arrived here (its
        own arrival for a single choice), then its own arrival."""
        entry = self._requests.get(_request_of(seq))
        return (seq.arrival if entry is None else entry[0]), seq.arrival

    # -- engine hooks (engine thread) -----------------------------------------------------------
    def holds_pool_pages(self) -> bool:
        return bool(self.live)  # reservations awaiting their transfer

    def queued(self) -> list[Sequence]:
        return list(self.waiting)

    def reader_stopped(self, request_id: str) -> bool:
        """No read for this request can be running: none began, or each that began has sent
        its notice (pull records stay until then)."""
        with self._lock:
            return not any(p.seq.request_id == request_id and p.read_at is not None for p in self.pulls.values())

    def stop_pull(self, request_id: str) -> bool:
        """The router gave up on the request (its abort is processed first): may prefill free
        its rows at once? Yes only if no read of it runs now and none can begin later. The
        second half needs memory: the request's own /internal/decode may still be on its way
        (found in review: answered "stopped" for a request not yet seen, prefill freed the rows
        and gave them to another request, and the late arrival then read them). So the id is
        refused here for as long as its lease could let a pull begin (check)."""
        if not self.reader_stopped(request_id):
            return False
        now = time.monotonic()
        while self._given_up and next(iter(self._given_up.values())) <= now:
            self._given_up.popitem(last=False)
        if request_id not in self._given_up and len(self._given_up) >= GIVEN_UP_MAX:
            self.counters["given_up_full"] += 1
            return False   # cannot promise to refuse it: the rows stay fenced
        s = self.settings   # a lease issued before now ends (on this clock) before lease + 2 skews
        self._given_up[request_id] = now + s.lease_s + 2 * s.clock_skew_s + 1.0
        self._given_up.move_to_end(request_id)
        return True

    def busy(self) -> bool:
        """Could a step reserve for a waiting request right now? Pages freed by a request
        that ended during a step make it so without any wake-up (found by the simulation:
        such a request otherwise waited for its lease to run out)."""
        return self._pick() is not None

    def _reserve_pages(self, seq: Sequence) -> int:
        """Pool pages reserved before the pull: the prompt and the first generated tokens. The
        rest come page by page as it generates, as on a single node, so a request without
        max_tokens (allowed the whole remaining context) does not pin a context for its life."""
        ahead = min(seq.max_tokens, self.settings.decode_reserve_tokens)
        return self.engine.ledger.pages_for(len(seq.prompt_ids) + ahead)

    def _fits(self, seq: Sequence) -> bool:
        eng = self.engine
        return (len(eng.scheduler.running) + len(self.live) < eng.config.max_num_seqs
                and self._reserve_pages(seq) <= eng.ledger.num_available
                and _manifest(seq).page_count <= self.staging.ledger.num_available)

    def _pick(self) -> Sequence | None:
        """The waiting request to reserve for next, or None. By need: among those that fit, the
        one whose tenant holds the fewest of decode's pages, then the oldest, so one tenant's
        large requests cannot hold the queue. A request passed over BYPASS_LIMIT times (others
        that arrived after it were reserved first) stops the rest of its kind until it fits:
        nothing starves.

        Requests preempted here wait in the scheduler for pages and go first (a new reservation
        would take the pages they need, and they have no lease to end them), except for a
        tenant that runs fewer sequences here than every tenant with one preempted: as on a
        single node, where the tenant running the fewest starts next. (A fairness probe: one
        tenant's n=16 requests filled decode's pool and kept preempting their own, and another
        tenant's handoff waited behind them for up to 40 s while its rows sat on prefill.) A
        tenant at its running share waits while another tenant's request could be reserved
        instead, as on a single node (but alone it is not held to it: see _candidates)."""
        chosen = self._choose()
        return None if chosen is None else chosen[0]

    def _candidates(self) -> list[Sequence]:
        """The waiting requests that may be reserved for now (see _pick), in arrival order."""
        running = self._running_by_tenant()
        preempted = self.engine.scheduler.waiting
        floor = min((running[s.tenant] for s in preempted), default=None)
        out = [s for s in self.waiting if floor is None or running[s.tenant] < floor]
        # a tenant at its running share waits while another tenant's request could go instead;
        # alone it is not held to it (a single node's queue has no lease: here its handoffs would
        # end with lease_expired while slots sat idle, a review found)
        share = self.engine.scheduler.max_seqs_per_tenant
        under = [s for s in out if running[s.tenant] < share]
        return under or out

    def _choose(self) -> tuple[Sequence, list[Sequence]] | None:
        """_pick's request and the candidates it was chosen among."""
        if not self.waiting:
            return None
        candidates = self._candidates()
        held = self._pages_by_tenant()
        seq = next_by_share(candidates, self._bypassed, self._fits,
                            lambda s: (held[s.tenant], *self._age(s)))
        return None if seq is None else (seq, candidates)

    def _sequences_here(self) -> Iterator[Sequence]:
        """The sequences this node runs: in the scheduler, and reserved awaiting their pull."""
        yield from self.engine.scheduler.running
        for pid in self.live.values():
            yield self.pulls[pid].seq

    def _running_by_tenant(self) -> Counter[str]:
        return Counter(s.tenant for s in self._sequences_here())

    def _pages_by_tenant(self) -> Counter[str]:
        held: Counter[str] = Counter()
        for s in self._sequences_here():
            held[s.tenant] += len(s.table)
        return held

    def next_timer(self) -> float | None:
        times = [p.started + self.settings.pull_give_up_s for p in self.pulls.values()
                 if self.live.get(p.seq.request_id) == p.pull_id]
        times += [_manifest(s).lease_deadline - self.settings.clock_skew_s for s in self.waiting]
        fence = self.staging.ledger.next_fence_time()
        if fence is not None:
            times.append(fence)
        return min(times) if times else None

    def before_step(self, now: float) -> Iterator[Decision]:
        while True:
            try:
                notice = self.notices.get_nowait()
            except queue.Empty:
                break
            yield from self._on_notice(*notice)
        for pid in list(self.live.values()):
            p = self.pulls[pid]
            if now - p.started > self.settings.pull_give_up_s:
                self.counters["pulls_given_up"] += 1
                yield self._abort(p.seq, "kv_transfer_timeout",
                                  f"the KV transfer did not finish within {self.settings.pull_give_up_s:g} s")
        yield from self._reserve_waiting(now)
        self.staging.ledger.lift_expired_fences(now)

    def on_end(self, seq: Sequence, event: Event, reader_stopped: bool) -> None:
        self._bypassed.pop(seq.request_id, None)
        key = _request_of(seq)
        entry = self._requests.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._requests[key]
        if seq in self.waiting:
            self.waiting.remove(seq)
        pid = self.live.pop(seq.request_id, None)
        if pid is None:
            return  # no rows held: never reserved, or the pull already ended and freed them
        p = self.pulls[pid]
        if faults.active("free_on_abort_during_transfer"):
            self.staging.ledger.free(p.owner, p.rows)
            return
        if faults.active("fence_pull_from_submit"):   # the old rule: a queued read may still begin
            self.fence(seq, p.owner, p.rows, "pull in flight", p.started + self.settings.max_pull_s)
            return
        with self._lock:
            began = p.read_at
            if began is None:
                p.cancelled = True       # still queued behind the workers: it will never read
        if began is None:
            self.staging.ledger.free(p.owner, p.rows)
            self.counters["pulls_cancelled"] += 1
            return
        # the read may still be writing these rows: keep them until its notice, or until no
        # read that began at `began` can still be running (I6)
        self.fence(seq, p.owner, p.rows, "pull in flight", began + self.settings.max_pull_s)

    # -- reservation and pulls -------------------------------------------------------------------
    def _reserve_waiting(self, now: float) -> Iterator[Decision]:
        for late in [s for s in self.waiting if now >= _manifest(s).lease_deadline - self.settings.clock_skew_s]:
            self.waiting.remove(late)
            self._bypassed.pop(late.request_id, None)
            yield self._abort(late, "lease_expired", "the prefill node's KV lease ran out before the "
                              "transfer could start", reader_stopped=True)
        while (chosen := self._choose()) is not None:
            seq, candidates = chosen
            m = _manifest(seq)
            self.waiting.remove(seq)
            self._bypassed.pop(seq.request_id, None)
            for other in candidates:   # passed over: only those that could have gone instead, and
                # older by the queue's own order (a choice of an older request is not passed over
                # by a later request's first choice: counted so, the barrier reinterleaved them)
                if self._age(other) < self._age(seq):
                    self._bypassed[other.request_id] += 1
            yield Reserve(seq, self._reserve_pages(seq))
            owner = Owner(self.staging.ledger.tenant_id(seq.tenant), seq.owner.request)
            rows = self.staging.grant(owner, m.page_count)
            pull = Pull(next(self._ids), seq, owner, rows, now)
            self.pulls[pull.pull_id] = pull
            self.live[seq.request_id] = pull.pull_id
            self.counters["pulls_started"] += 1
            if m.page_count == 0:
                self.notices.put((pull.pull_id, True, None, 0, 0.0))
            else:
                self._workers.submit(self._pull, pull, _handoff(seq))

    def begin_read(self, pull: Pull, m: Manifest) -> str | None:
        """Called by whoever runs the read, just before it begins: None to go ahead, else why
        it must not (its request gave up while it waited for a worker, or the lease no
        longer lets a read begin). Either way a read that has not begun never begins, so its
        rows were free to go at once (I6 for queued pulls)."""
        if faults.active("fence_pull_from_submit"):
            return None
        with self._lock:
            if pull.cancelled:
                return "the request gave up on this pull before its read began"
            now = self.engine.clock()
            if now >= m.lease_deadline - self.settings.clock_skew_s:
                pull.cancelled = True
                return "the prefill node's KV lease ran out before the read could begin"
            pull.read_at = now
            return None

    def _pull(self, pull: Pull, h: Handoff) -> None:
        """Worker thread: one one-sided read of every row, from the source the router named
        (never an address from the manifest), then a notice to the engine thread."""
        t0 = time.perf_counter()
        m, rows, pull_id = h.manifest, list(pull.rows.pages), pull.pull_id
        notice: tuple[int, bool, str | None, int, float]
        refused = self.begin_read(pull, m)
        if refused is not None:
            notice = (pull_id, False, refused, 0, 0.0)
            self.notices.put(notice)
            self.engine.wake()
            return
        try:
            nbytes = self.transport.read(h.source.session, self.staging.row_addresses(rows),
                                         h.source.row_addresses(m), [m.slot_bytes] * len(rows))
            notice = (pull_id, True, None, nbytes, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any failure of the transfer is a failed pull
            notice = (pull_id, False, f"{type(e).__name__}: {e}", 0, time.perf_counter() - t0)
        kill_point("decode_after_pull")
        if faults.active("drop_transfer_completion"):
            return
        if faults.active("delay_transfer_completion"):
            time.sleep(faults.arg_float("delay_transfer_completion", 1.0))
        self.notices.put(notice)
        if faults.active("duplicate_transfer_completion"):
            self.notices.put(notice)
        self.engine.wake()

    def _on_notice(self, pull_id: int, ok: bool, error: str | None, nbytes: int,
                   seconds: float) -> Iterator[Decision]:
        p = self.pulls.pop(pull_id, None)
        if p is None:
            self.counters["stale_notices"] += 1  # a duplicate: its pull was settled already
            return
        seq = p.seq
        if self.live.get(seq.request_id) != pull_id:
            # the request gave up on this pull; now nothing writes its rows any more
            self.staging.ledger.lift_fence(p.owner.request)
            self.counters["late_notices"] += 1
            return
        self.transferred_bytes += nbytes
        self.transfer_seconds += seconds
        # the read is over: whatever goes wrong from here, the rows can go at once
        yield from contained(seq, self._arrive(p, ok, error), undo=lambda: self._settle(p))

    def _arrive(self, p: Pull, ok: bool, error: str | None) -> Iterator[Decision]:
        """The read of p's rows is over: authenticate and unstage them, or fail the request."""
        seq = p.seq
        if not ok:
            self.counters["pulls_failed"] += 1
            if p.cancelled:   # the lease ran out while the read waited for a worker
                yield self._settle_and_abort(p, "lease_expired", f"the KV transfer did not begin: {error}")
                return
            yield self._settle_and_abort(p, "kv_transfer_failed", f"the KV transfer failed: {error}")
            return
        m = _manifest(seq)
        secret = self.sealing_secret(m)
        if secret is None:   # held at check(); a reload (SIGHUP) dropped it while the rows were pulled
            log.warning("request %s: its rows are sealed under cluster secret key id %s, which a reload of the "
                        "secret files dropped after the handoff was admitted: wait a lease and a pull after "
                        "step 2 of a rotation before step 3 (docs/pd.md)", seq.request_id, m.seal_key)
            yield self._settle_and_abort(p, "kv_manifest_invalid", f"the cluster secret that sealed the rows (key "
                                         f"id {m.seal_key}) was dropped by a reload on this node before they "
                                         "were opened")
            return
        t0 = time.perf_counter()
        try:  # authenticated and decrypted once, in private memory (kvfence/pd/seal.py)
            plain = self.staging.open_rows(p.rows.pages, m, self.cipher(secret, m, seq),
                                           authenticate=not faults.active("skip_row_auth"))
        except SealError as e:
            self.counters["verify_failed"] += 1
            log.error("request %s: transferred KV failed verification: %s", seq.request_id, e)
            incidents.record("transfer_verification_failed", request_id=seq.request_id, tenant=seq.tenant,
                             involved=[seq.tenant], rows=p.rows.pages, detail=str(e),
                             client=incidents.client_outcome("kv_verification_failed", 0))
            yield self._settle_and_abort(p, "kv_verification_failed", f"the transferred KV failed verification: {e}")
            return
        if faults.active("poison_link") and int(faults.arg("poison_link") or -1) in seq.prompt_ids:
            raise RuntimeError("fault injection: opening a poisoned request's rows raises")
        self.staging.unstage(plain, seq.table.pages[:m.page_count])
        self.open_seconds += time.perf_counter() - t0
        self._settle(p)
        self.counters["verified"] += 1
        yield KvArrived(seq, m.token_count)  # the engine sets the written watermark and runs it

    def _settle(self, p: Pull) -> None:
        """p's read is over and its request no longer waits on it: its rows go at once."""
        if self.live.get(p.seq.request_id) == p.pull_id:
            del self.live[p.seq.request_id]
            self.staging.ledger.free(p.owner, p.rows)

    def _settle_and_abort(self, p: Pull, code: str, message: str) -> Decision:
        self._settle(p)
        return self._abort(p.seq, code, message, reader_stopped=True)

    def _abort(self, seq: Sequence, code: str, message: str, reader_stopped: bool | None = None) -> Decision:
        stopped = reader_stopped if reader_stopped is not None else seq.request_id not in self.live
        return EndRequest(seq, code, message, reader_stopped=stopped, notify=True)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {**self.buffer_stats(), "awaiting_kv": len(self.live), "waiting_for_pages": len(self.waiting),
                "transferred_bytes": self.transferred_bytes, "transfer_seconds": round(self.transfer_seconds, 4),
                "open_seconds": round(self.open_seconds, 4)}
