"""Turns a scheduled step into a forward pass: ledger check, slot tables, model, logits.

The slot indices the model reads come from the very block-table entries the ledger just
authorized (I2, I3); there is no other path from a request to pool memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvfence.engine.scheduler import ScheduledSeq
from kvfence.kv.audit import AuditRow, ReadAudit
from kvfence.kv.ledger import NULL_PAGE, Ledger, ReadRequest, Violation
from kvfence.kv.pool import KVPool
from kvfence.model.llama import AttentionBucket, ForwardBatch, LlamaModel


@dataclass
class StepResult:
    ran: list[ScheduledSeq]            # sequences that went through the model
    logits: torch.Tensor | None        # [len(sampled), vocab] float32
    sampled: list[ScheduledSeq]        # those whose last position produced logits
    violations: list[tuple[ScheduledSeq, Violation]]


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, ledger: Ledger, audit: ReadAudit | bool | None = None):
        """audit: a ReadAudit (or True for a new one on this ledger) that sees every batch
        just before the model runs it; None (the default) audits nothing. Callers may also
        set `runner.audit` later."""
        self.model = model
        self.pool = pool
        self.ledger = ledger
        self.audit: ReadAudit | None = ReadAudit(ledger) if audit is True else (audit or None)
        self.device = pool.device
        self.ps = pool.page_size
        self.check_seconds = 0.0   # time spent in the ledger check, for the bench's cost report

    def run(self, step: list[ScheduledSeq]) -> StepResult:
        reads = [ReadRequest(s.seq.owner, s.seq.table, s.seq.num_computed, s.num_new) for s in step]
        t0 = time.perf_counter()
        violations = self.ledger.authorize(reads)
        self.check_seconds += time.perf_counter() - t0
        bad = {v.index for v in violations}
        flagged = [(step[v.index], v) for v in violations]
        ok = [s for i, s in enumerate(step) if i not in bad]
        if not ok:
            return StepResult([], None, [], flagged)
        # Decodes first, then fresh prefills grouped by length, then prefills with cached context.
        ok.sort(key=lambda s: (s.num_new != 1, s.seq.num_computed > 0, s.num_new))
        batch, sampled = self._build(ok)
        if self.audit is not None:  # what the model will touch, checked against the ledger as it is now
            self.audit.record(batch, self._audit_rows(ok))
        logits = self.model.forward(batch, self.pool.kv)
        for s in ok:
            start = s.seq.num_computed
            s.seq.num_computed += s.num_new
            self.ledger.mark_written(s.seq.owner, s.seq.table, start, s.seq.num_computed)
        return StepResult(ok, logits, sampled, flagged)

    @staticmethod
    def _audit_rows(step: list[ScheduledSeq]) -> list[AuditRow]:
        rows, start = [], 0
        for s in step:  # the order _build lays tokens out in
            rows.append(AuditRow(s.seq.owner, s.seq.request_id, start, s.num_new))
            start += s.num_new
        return rows

    def _slots(self, pages: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        return np.asarray(pages, dtype=np.int64)[pos // self.ps] * self.ps + pos % self.ps

    def _build(self, step: list[ScheduledSeq]) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        ids, positions, writes, logits_rows, sampled = [], [], [], [], []
        row = 0
        for s in step:
            seq = s.seq
            start, end = seq.num_computed, seq.num_computed + s.num_new
            ids.extend(seq.all_ids[start:end])
            positions.append(np.arange(start, end))
            writes.append(self._slots(seq.table.pages, start, end))
            row += s.num_new
            if end == seq.num_tokens and not seq.hold_kv:  # PD prefill samples nothing
                logits_rows.append(row - 1)
                sampled.append(s)
        buckets = []
        i, row = 0, 0
        while i < len(step):
            j = i
            first = step[i]
            fresh = first.num_new > 1 and first.seq.num_computed == 0
            # extend the bucket over neighbours with the same shape class
            while j + 1 < len(step) and step[j + 1].num_new == first.num_new and (
                    first.num_new == 1 or (fresh and step[j + 1].seq.num_computed == 0)):
                j += 1
            group = step[i:j + 1]
            buckets.append(self._bucket(group, row, fresh))
            row += sum(g.num_new for g in group)
            i = j + 1
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            write_slots=torch.from_numpy(np.concatenate(writes)).to(dev),
            buckets=buckets,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            page_size=self.ps,
        )
        return batch, sampled

    def _bucket(self, group: list[ScheduledSeq], token_start: int, fresh: bool) -> AttentionBucket:
        q = group[0].num_new
        if fresh:  # only this pass's own keys: causal attention, no pool reads
            return AttentionBucket(token_start, len(group), q, None, None)
        totals = np.array([g.seq.num_computed + q for g in group])
        n_pages = -(-int(totals.max()) // self.ps)
        pages = np.full((len(group), n_pages), NULL_PAGE, dtype=np.int64)
        for r, g in enumerate(group):
            need = -(-int(totals[r]) // self.ps)
            pages[r, :need] = g.seq.table.pages[:need]
        pos = np.arange(n_pages * self.ps)
        ctx = totals - q  # cached tokens before this pass, per row
        # query i of row r sits at position ctx[r] + i and may see keys 0 .. ctx[r] + i
        mask = pos[None, None, :] <= (ctx[:, None, None] + np.arange(q)[None, :, None])
        dev = self.device
        return AttentionBucket(token_start, len(group), q, torch.from_numpy(pages).to(dev),
                               torch.from_numpy(mask).unsqueeze(1).to(dev))
