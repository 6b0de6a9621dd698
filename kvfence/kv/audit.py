"""Read audit: the strong oracle for I1-I3, independent of `Ledger.authorize`.

Off by default. When on, the model runner hands it every forward batch just before the
model runs, and it looks at what the model will actually touch: the pool pages, page
tables and key lengths in the batch's AttentionRows and its write slots, not what the block
tables or the scheduler meant. For every sequence it records which (page, epoch, slot
range) it attends and writes, and checks each against the ledger's owner record at that
moment:

  read_foreign    an attended page is neither owned by the reader nor a SHARED prefix page
                  of the reader's cache scope (someone else's, free, quarantined)
  read_unwritten  an attended slot was not written in the page's current epoch (its
                  written watermark) and is not written by the reader in this very pass:
                  it holds an earlier owner's bytes
  read_null       an attended slot lies on the null (padding) page
  write_foreign   a written slot lies on a page the writer does not own (a shared, free,
                  quarantined or null page, or another request's)

It never calls `authorize`, and does not read block tables or epochs from them, so it still
sees a foreign read when the authorize check is switched off, skipped by a fault, or
wrong. It only records: stopping the read is the ledger check's job. Tests and tools
read `violations`, `counters` and the bounded `log` of per-step entries.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from kvfence.kv.ledger import NULL_PAGE, Ledger, Owner, PageState

KINDS = ("read_foreign", "read_unwritten", "read_null", "write_foreign")

# one row per (sequence, table position) per step: what it touched on that page
ENTRY = np.dtype([("request", np.int64), ("page", np.int64), ("epoch", np.int64), ("first", np.int32),
                  ("last", np.int32), ("write", np.bool_)])


@dataclass(frozen=True)
class AuditRow:
    """Which rows of the flat forward batch belong to one sequence."""
    owner: Owner
    request_id: str
    token_start: int
    num_tokens: int


@dataclass(frozen=True)
class AuditViolation:
    step: int
    kind: str                 # one of KINDS
    request: int              # the reader's engine-wide request number
    request_id: str
    tenant: int
    page: int
    epoch: int                # the page's epoch in the ledger at that moment
    first_slot: int           # slot range within the page (inclusive) that was touched badly
    last_slot: int
    page_state: str           # the ledger's record for the page at that moment
    page_owner_request: int
    page_owner_scope: int
    page_written: int

    def describe(self) -> str:
        return (f"step {self.step}: request {self.request_id} (#{self.request}, tenant {self.tenant}) "
                f"{self.kind.replace('_', ' ')} on page {self.page} slots {self.first_slot}..{self.last_slot}; "
                f"ledger: {self.page_state}, owner request {self.page_owner_request}, scope "
                f"{self.page_owner_scope}, epoch {self.epoch}, {self.page_written} slots written")


@dataclass(frozen=True)
class StepRecord:
    step: int
    request_ids: dict[int, str]   # request number -> request id, for the entries below
    entries: np.ndarray           # ENTRY rows


class ReadAudit:
    def __init__(self, ledger: Ledger, log_steps: int = 32, max_violations: int = 10_000):
        self.ledger = ledger
        self.log: deque[StepRecord] = deque(maxlen=max(0, log_steps))  # the last steps' entries
        self.max_violations = max_violations
        self.violations: list[AuditViolation] = []
        self.counters: Counter[str] = Counter()
        self.steps = 0
        self.seconds = 0.0   # time spent recording, for the cost report

    @property
    def clean(self) -> bool:
        return not self.counters["violations"]

    def clear(self) -> None:
        self.violations.clear()
        self.counters.clear()
        self.log.clear()

    def violations_of(self, request_id: str) -> list[AuditViolation]:
        return [v for v in self.violations if v.request_id == request_id]

    def entries_of(self, request_id: str) -> np.ndarray:
        """Every logged entry (still in the bounded log) of one request."""
        parts = []
        for rec in self.log:
            nums = [n for n, rid in rec.request_ids.items() if rid == request_id]
            if nums:
                parts.append(rec.entries[np.isin(rec.entries["request"], nums)])
        return np.concatenate(parts) if parts else np.empty(0, ENTRY)

    # -- the check ------------------------------------------------------------------------
    def record(self, batch, rows: list[AuditRow]) -> list[AuditViolation]:
        """Audit one forward batch (a kvfence.model.llama.ForwardBatch) before it runs;
        rows say which flat-batch rows are which sequence. Returns this step's violations."""
        t0 = time.perf_counter()
        try:
            return self._record(batch, rows)
        finally:
            self.seconds += time.perf_counter() - t0

    def _record(self, batch, rows: list[AuditRow]) -> list[AuditViolation]:
        led = self.ledger
        ps = int(batch.page_size)
        step = self.steps
        self.steps += 1
        self.counters["steps"] += 1
        self.counters["sequences"] += len(rows)
        writes = _np(batch.write_slots).astype(np.int64, copy=False)
        n_tok = writes.shape[0]
        tok_seq = np.full(n_tok, -1, dtype=np.int64)
        for i, r in enumerate(rows):
            tok_seq[r.token_start:r.token_start + r.num_tokens] = i
        req = np.array([r.owner.request for r in rows], dtype=np.int64)
        scope = np.array([r.owner.cache_scope for r in rows], dtype=np.int64)

        # writes: every new token's K/V slot
        w_seq = tok_seq
        w_page, w_slot = writes // ps, writes % ps
        unattributed = w_seq < 0
        w_req = np.where(unattributed, -2, req[np.maximum(w_seq, 0)])
        w_ok = ((led.state[w_page] == PageState.OWNED) & (led.owner_request[w_page] == w_req)
                & (w_page != NULL_PAGE))
        self.counters["slots_written"] += n_tok

        # reads: every (row, position) the row's queries may see, on the page its table puts
        # there (fresh prefills included: the fused kernels read their keys back from the pool)
        a = batch.attn
        pages = _np(a.pages).astype(np.int64, copy=False)
        seen = _np(a.visible(ps))
        ri, pos = np.nonzero(seen)
        col = pos // ps
        r_seq = tok_seq[_np(a.q_start).astype(np.int64, copy=False)[ri]]
        r_page = pages[ri, col]
        r_slot = pos % ps
        # one group per (row, page column): the count of distinct page reads
        grp_start = np.ones(len(r_seq), dtype=bool)
        if len(r_seq) > 1:
            g = ri * pages.shape[1] + col
            grp_start[1:] = g[1:] != g[:-1]
        n_read = len(r_seq)
        self.counters["slots_read"] += n_read
        self.counters["pages_read"] += int(grp_start.sum())

        r_req, r_scope = req[r_seq], scope[r_seq]
        st = led.state[r_page]
        own = (st == PageState.OWNED) & (led.owner_request[r_page] == r_req)
        shared = (st == PageState.SHARED) & (led.owner_tenant[r_page] == r_scope)
        null = r_page == NULL_PAGE
        foreign = ~(own | shared | null)
        pre_written = r_slot < led.written[r_page]
        unwritten = (own | shared) & ~pre_written
        if unwritten.any():
            # a slot the reader writes in this very pass is fine: the model writes before it attends
            stride = np.int64(led.num_pages * ps)
            key_w = w_seq * stride + writes
            key_r = r_seq * stride + r_page * ps + r_slot
            unwritten &= ~np.isin(key_r, key_w)

        found: list[AuditViolation] = []
        for kind, mask, seqs, pages, slots in (
                ("read_foreign", foreign, r_seq, r_page, r_slot),
                ("read_unwritten", unwritten, r_seq, r_page, r_slot),
                ("read_null", null, r_seq, r_page, r_slot),
                ("write_foreign", ~w_ok, w_seq, w_page, w_slot)):
            if mask.any():
                found += self._violations(step, kind, rows, seqs[mask], pages[mask], slots[mask])
        if found:
            self.counters["violations"] += len(found)
            for v in found:
                self.counters[f"violations:{v.kind}"] += 1
            room = self.max_violations - len(self.violations)
            self.violations.extend(found[:max(0, room)])

        if self.log.maxlen:
            self.log.append(self._entries(step, rows, req, r_seq, r_page, r_slot, grp_start,
                                          w_seq, w_page, w_slot))
        return found

    def _violations(self, step, kind, rows, seqs, pages, slots) -> list[AuditViolation]:
        led = self.ledger
        out, by_key = [], {}
        for s, p, sl in zip(seqs.tolist(), pages.tolist(), slots.tolist()):
            lo_hi = by_key.get((s, p))
            by_key[(s, p)] = (sl, sl) if lo_hi is None else (min(lo_hi[0], sl), max(lo_hi[1], sl))
        for (s, p), (lo, hi) in by_key.items():
            row = rows[s] if s >= 0 else None
            out.append(AuditViolation(
                step=step, kind=kind, request=row.owner.request if row else -1,
                request_id=row.request_id if row else "?", tenant=row.owner.tenant if row else -1, page=p,
                epoch=int(led.epoch[p]), first_slot=lo, last_slot=hi,
                page_state=PageState(led.state[p]).name.lower(), page_owner_request=int(led.owner_request[p]),
                page_owner_scope=int(led.owner_tenant[p]), page_written=int(led.written[p])))
        return out

    def _entries(self, step, rows, req, r_seq, r_page, r_slot, grp_start, w_seq, w_page, w_slot) -> StepRecord:
        led = self.ledger
        starts = np.flatnonzero(grp_start)
        ends = np.append(starts[1:], len(r_seq))[:len(starts)] - 1
        reads = np.empty(len(starts), ENTRY)
        reads["request"] = req[r_seq[starts]] if len(starts) else []
        reads["page"] = r_page[starts]
        reads["epoch"] = led.epoch[r_page[starts]]
        reads["first"] = r_slot[starts]
        reads["last"] = r_slot[ends]
        reads["write"] = False
        # writes: consecutive rows of one sequence on one page form one entry
        if len(w_seq):
            ws = np.ones(len(w_seq), dtype=bool)
            ws[1:] = (w_seq[1:] != w_seq[:-1]) | (w_page[1:] != w_page[:-1])
            wst = np.flatnonzero(ws)
            wen = np.append(wst[1:], len(w_seq)) - 1
            wr = np.empty(len(wst), ENTRY)
            wr["request"] = np.where(w_seq[wst] >= 0, req[np.maximum(w_seq[wst], 0)], -1)
            wr["page"] = w_page[wst]
            wr["epoch"] = led.epoch[w_page[wst]]
            wr["first"] = w_slot[wst]
            wr["last"] = w_slot[wen]
            wr["write"] = True
            reads = np.concatenate([reads, wr])
        return StepRecord(step, {r.owner.request: r.request_id for r in rows}, reads)

    def summary(self) -> dict:
        return {"steps": self.steps, "violations": int(self.counters["violations"]),
                "by_kind": {k: int(self.counters[f"violations:{k}"]) for k in KINDS},
                "slots_read": int(self.counters["slots_read"]), "pages_read": int(self.counters["pages_read"]),
                "slots_written": int(self.counters["slots_written"]), "seconds": round(self.seconds, 6)}


def _np(t) -> np.ndarray:
    """A tensor's values as numpy (a copy to host memory when it lives on an accelerator)."""
    if hasattr(t, "detach"):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy()
    return np.asarray(t)
