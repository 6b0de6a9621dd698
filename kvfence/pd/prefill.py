"""Prefill side of a handoff: compute the prompt, stage its KV, hold it under a lease.

A request arrives with `hold_kv`: the engine computes every prompt token but the last
(decode computes that one, so all sampling happens in one place), then hands the request
here instead of sampling. Here its pages pass the ledger's read check, are sealed into
transfer-buffer rows (AES-GCM under a key for this hold, each row bound to its page
header; kvfence/pd/seal.py), the pool pages go back (or into the prefix cache), and the
rows are held under a lease (KV_HELD). The router gets the manifest. The lease ends one
of three ways:

- RELEASE: decode acknowledged a verified transfer; the rows are freed.
- ABORT with the reader known stopped (decode said no pull is running): freed.
- ABORT otherwise (client gone, lease expired, decode failed or vanished): the rows stay
  fenced until `settings.fence_after(deadline)`, when no pull can still be reading them.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvfence import faults
from kvfence.engine.kv_link import Decision, EndRequest, Hold, ReadRefused, ReleaseRequest, contained
from kvfence.engine.request_states import Event
from kvfence.engine.sequence import Sequence
from kvfence.kv.ledger import BlockTable, Owner
from kvfence.pd.link import PdLink
from kvfence.pd.manifest import Manifest
from kvfence.pd.seal import key_id, new_salt
from kvfence.pd.settings import PDSettings

log = logging.getLogger("kvfence.pd.prefill")


def kill_point(point: str) -> None:
    """Fault injection: die here, like a crashed node (no cleanup, no goodbye)."""
    if faults.active("kill_node_at") and faults.arg("kill_node_at") == point:
        log.error("fault injection: killing this node at %s", point)
        os._exit(137)


# stagings (prefill) or reservations (decode) that may be made past a waiting request for later
# arrivals before it blocks the queue until it fits; bounds how long ordering by need and share
# can pass a large request over
BYPASS_LIMIT = 8


def next_by_share(queue: list[Sequence], bypassed: Counter[str], fits: Callable[[Sequence], bool],
                  key: Callable[[Sequence], Any]) -> Sequence | None:
    """Prefill's staging and decode's reservations alike: of `queue` (arrival order), the first
    passed over BYPASS_LIMIT times if any (it stops the rest until it fits: nothing starves),
    else the first by `key` (the tenant's share held; a stable sort keeps arrival order) that
    fits; None: nothing can go now."""
    for seq in queue:
        if bypassed[seq.request_id] >= BYPASS_LIMIT:
            return seq if fits(seq) else None
    return next((seq for seq in sorted(queue, key=key) if fits(seq)), None)


@dataclass
class Held:
    seq: Sequence
    owner: Owner          # the rows' owner record in the transfer buffer's ledger
    rows: BlockTable
    manifest: Manifest


class KvExporter(PdLink):
    def __init__(self, engine, settings: PDSettings, transport):
        super().__init__(engine, settings, transport)
        self.held: dict[str, Held] = {}
        self.pending: list[Sequence] = []   # prompt computed, waiting for transfer-buffer rows
        self._bypassed: Counter[str] = Counter()   # request id -> stagings made past it while it waited

    # -- engine hooks (engine thread) ------------------------------------------------------
    def busy(self) -> bool:
        """Could poll() stage a waiting prompt right now? (Otherwise rows come back on a
        release, an abort or a timer, each of which wakes the loop.)"""
        return self._next_to_stage() is not None

    def _fits(self, seq: Sequence) -> bool:
        return self.engine.ledger.pages_for(seq.num_computed) <= self.staging.ledger.num_available

    def _next_to_stage(self) -> Sequence | None:
        """The computed prompt to give rows to next, or None: among those that fit, the one whose
        tenant holds the fewest rows, then the oldest (in arrival order they went first come,
        first served, and a fairness probe saw one tenant hold 1,400 of 1,455 rows with handoffs
        decode could not take yet while another tenant's prompt waited behind them). One passed
        over BYPASS_LIMIT times stops the rest until it fits: nothing starves."""
        held: Counter[str] = Counter()
        for h in self.held.values():
            held[h.seq.tenant] += len(h.rows)
        return next_by_share(self.pending, self._bypassed, self._fits, lambda s: held[s.tenant])

    def queued(self) -> list[Sequence]:
        return list(self.pending)

    def holds_pool_pages(self) -> bool:
        return bool(self.pending)  # computed prompts keep their pool pages until rows are free

    def next_timer(self) -> float | None:
        times = [h.manifest.lease_deadline for h in self.held.values()]
        fence = self.staging.ledger.next_fence_time()
        if fence is not None:
            times.append(fence)
        return min(times) if times else None

    def after_step(self, prefilled: list[Sequence], now: float) -> Iterator[Decision]:
        """Prompts computed this step (the engine took them out of its scheduler)."""
        self.pending += prefilled
        yield from self._stage_pending(now)

    def before_step(self, now: float) -> Iterator[Decision]:
        # end leases and lift fences first: the rows they give back may be what a waiting
        # prompt needs (found by the simulation: staged first, such a prompt could strand)
        for rid in [r for r, h in self.held.items() if h.manifest.lease_deadline <= now]:
            self.counters["leases_expired"] += 1
            yield EndRequest(self.held[rid].seq, "lease_expired",
                             "the KV lease expired before decode acknowledged the transfer", reader_stopped=False)
        self.staging.ledger.lift_expired_fences(now)
        yield from self._stage_pending(now)

    def on_end(self, seq: Sequence, event: Event, reader_stopped: bool) -> None:
        self._bypassed.pop(seq.request_id, None)
        if seq in self.pending:
            self.pending.remove(seq)
        h = self.held.pop(seq.request_id, None)
        if h is None:
            return
        if event is Event.RELEASE or reader_stopped:
            self.staging.ledger.free(h.owner, h.rows)
        else:
            self.fence(seq, h.owner, h.rows, "lease ended without an ACK", self.settings.fence_after(
                h.manifest.lease_deadline))

    # -- control messages (engine thread) ----------------------------------------------------
    def release(self, request_id: str) -> Iterator[Decision]:
        """Decode verified the transfer: end the lease (on_end frees the rows)."""
        h = self.held.get(request_id)
        if h is not None:
            self.counters["released"] += 1
            yield ReleaseRequest(h.seq)
        else:   # verified after its lease ended: the rows were fenced, and now nothing reads them
            self.lift_fence_of(request_id)

    def abort(self, request_id: str, reader_stopped: bool, reason: str) -> Iterator[Decision]:
        seq = self.engine.requests.get(request_id)
        if seq is not None and not seq.finished:
            yield EndRequest(seq, "aborted_by_peer", reason, reader_stopped=reader_stopped)
        elif reader_stopped:   # ended (its lease ran out) before decode's word came
            self.lift_fence_of(request_id)

    # -- staging ---------------------------------------------------------------------------
    def _stage_pending(self, now: float) -> Iterator[Decision]:
        # what does not fit keeps its pool pages until rows come back as leases end
        while (seq := self._next_to_stage()) is not None:
            at = self.pending.index(seq)
            del self.pending[at]
            self._bypassed.pop(seq.request_id, None)
            for other in self.pending[:at]:   # those that arrived before it
                self._bypassed[other.request_id] += 1
            yield from contained(seq, self._hold(seq, now))

    def _hold(self, seq: Sequence, now: float) -> Iterator[Decision]:
        eng, tokens = self.engine, seq.num_computed
        n = eng.ledger.pages_for(tokens)
        # staging reads pool pages, so it passes the same check as a forward pass (I2, I3)
        bad = eng.authorize_read(seq, tokens)
        if bad is not None:
            yield ReadRefused(seq, bad)
            return
        owner = Owner(self.staging.ledger.tenant_id(seq.tenant), seq.owner.request)
        rows = self.staging.grant(owner, n)
        try:
            m = self._stage(seq, owner, rows, now)
        except Exception:
            self.staging.ledger.free(owner, rows)   # no manifest went out: nobody can read them
            raise
        self.held[seq.request_id] = Held(seq, owner, rows, m)
        self.counters["held"] += 1
        kill_point("prefill_after_hold")
        yield Hold(seq, m.to_json())  # the engine frees the pool pages (after publishing the prefix)

    def _stage(self, seq: Sequence, owner: Owner, rows, now: float) -> Manifest:
        """Seal seq's computed pages into `rows`; the manifest that describes them."""
        eng, tokens, n = self.engine, seq.num_computed, len(rows.pages)
        if faults.active("poison_link") and int(faults.arg("poison_link") or -1) in seq.prompt_ids:
            raise RuntimeError("fault injection: staging a poisoned request raises")
        own = self.settings.secrets.own   # one read: the key id named is that of the key sealed with
        m = Manifest(request_id=seq.request_id, tenant=seq.tenant, token_count=tokens, page_count=n,
                     page_size=eng.ledger.page_size, epochs=list(rows.epochs),
                     fingerprint=eng.model_config.fingerprint(), layout=self.staging.layout, boot_id=self.boot_id,
                     seal_salt=new_salt(), seal_key=key_id(own),
                     slot_bytes=self.staging.slot_bytes, slots=list(rows.pages),
                     lease_deadline=now + self.settings.lease_s, issued_at=now)
        self.staging.stage(seq.table.pages[:n], rows, m, self.cipher(own, m, seq),
                           seal=not faults.active("skip_row_seal"))
        if n and faults.active("corrupt_staged_page"):
            self.staging.buf[rows.pages[0], -1] ^= 0x5A
        return m

    def stats(self) -> dict:
        return {**self.buffer_stats(), "held": len(self.held), "pending": len(self.pending)}
