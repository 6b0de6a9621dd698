"""Turns a scheduled step into a forward pass: ledger check, slot tables, model, logits.

The slot indices the model reads come from the very block-table entries the ledger just
authorized (I2, I3); there is no other path from a request to pool memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfence import faults, incidents
from kvfence.engine.scheduler import ScheduledSeq
from kvfence.kv.audit import AuditRow, ReadAudit
from kvfence.kv.ledger import NULL_PAGE, Ledger, ReadRequest, Violation
from kvfence.kv.pool import KVPool
from kvfence.model.llama import AttentionRows, ForwardBatch, LlamaModel


@dataclass
class PromptRows:
    """Prompt positions of one sequence whose next-token logits this pass computed, for its
    prompt logprobs: prompt tokens first .. first + count - 1, each scored by the position before."""
    seq: ScheduledSeq
    first: int     # index in prompt_ids of the first token scored
    count: int


@dataclass
class StepResult:
    ran: list[ScheduledSeq]            # sequences that went through the model
    logits: torch.Tensor | None        # [len(sampled), vocab] float32
    sampled: list[ScheduledSeq]        # those whose last position produced logits
    violations: list[tuple[ScheduledSeq, Violation]]
    prompt_logits: torch.Tensor | None = None   # [sum of counts, vocab] float32, in prompt_rows' order
    prompt_rows: list[PromptRows] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, ledger: Ledger, audit: ReadAudit | bool | None = None,
                 fused_kernels: bool = True):
        """audit: a ReadAudit (or True for a new one on this ledger) that sees every batch
        just before the model runs it; None (the default) audits nothing. Callers may also
        set `runner.audit` later."""
        self.model = model
        self.pool = pool
        self.ledger = ledger
        self.audit: ReadAudit | None = ReadAudit(ledger) if audit is True else (audit or None)
        self.device = pool.device
        self.ps = pool.page_size
        self.fused_kernels = fused_kernels
        self.check_seconds = 0.0   # time spent in the ledger check, for the bench's cost report

    def run(self, step: list[ScheduledSeq]) -> StepResult:
        if faults.active("poison_forward"):
            which = faults.arg("poison_forward") or "all"
            if which == "all" or any(int(which) in s.seq.prompt_ids for s in step):
                raise RuntimeError("fault injection: a poisoned forward pass")
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
        batch, sampled, prompt_rows = self._build(ok)
        if self.audit is not None:  # what the model will touch, checked against the ledger as it is now
            for v in self.audit.record(batch, self._audit_rows(ok)):
                owner = self.ledger.tenant_name(v.page_owner_scope)
                incidents.record("audit_violation", request_id=v.request_id, tenant=self.ledger.tenant_name(v.tenant),
                                 involved=[owner] if owner else [], pages=[v.page],
                                 other_party=self.ledger.same_name_other_party(v.tenant, v.page_owner_scope),
                                 detail=f"{v.kind} on page {v.page} slots {v.first_slot}..{v.last_slot} "
                                        f"({v.page_state}, epoch {v.epoch})")
        logits = self.model.forward(batch, self.pool.kv, fused=self.fused_kernels)
        for s in ok:
            start = s.seq.num_computed
            s.seq.num_computed += s.num_new
            self.ledger.mark_written(s.seq.owner, s.seq.table, start, s.seq.num_computed)
        if prompt_rows:   # the same LM head call: rows after the sampled ones
            n = len(sampled)
            return StepResult(ok, logits[:n], sampled, flagged, logits[n:], prompt_rows)
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

    def _build(self, step: list[ScheduledSeq]) -> tuple[ForwardBatch, list[ScheduledSeq], list[PromptRows]]:
        ids, positions, writes, logits_rows, sampled = [], [], [], [], []
        prompt_rows: list[PromptRows] = []
        prompt_logits_rows: list[np.ndarray] = []
        rows = len(step)
        q_start = np.empty(rows, dtype=np.int64)
        q_len = np.empty(rows, dtype=np.int64)
        kv_len = np.empty(rows, dtype=np.int64)
        row = 0
        for r, s in enumerate(step):
            seq = s.seq
            start, end = seq.num_computed, seq.num_computed + s.num_new
            ids.extend(seq.all_ids[start:end])
            positions.append(np.arange(start, end))
            writes.append(self._slots(seq.table.pages, start, end))
            q_start[r], q_len[r], kv_len[r] = row, s.num_new, end
            if seq.params.prompt_logprobs is not None:
                # prompt token t is scored by position t - 1; tokens already scored (before a
                # preemption) are not scored again
                first = max(start + 1, len(seq.prompt_logprobs) + 1)
                stop = min(end + 1, len(seq.prompt_ids))
                if first < stop:
                    prompt_rows.append(PromptRows(s, first, stop - first))
                    prompt_logits_rows.append(np.arange(row + first - 1 - start, row + stop - 1 - start))
            row += s.num_new
            # PD prefill samples nothing, nor does a request for no tokens (max_tokens 0)
            if end == seq.num_tokens and not seq.hold_kv and seq.max_tokens > 0:
                logits_rows.append(row - 1)
                sampled.append(s)
        # each row's pages up to its last key, padded with the null page (never read)
        width = -(-int(kv_len.max()) // self.ps)
        pages = np.full((rows, width), NULL_PAGE, dtype=np.int64)
        for r, s in enumerate(step):
            need = -(-int(kv_len[r]) // self.ps)
            pages[r, :need] = s.seq.table.pages[:need]
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            write_slots=torch.from_numpy(np.concatenate(writes)).to(dev),
            attn=AttentionRows(*(torch.from_numpy(t).to(dev) for t in (q_start, q_len, kv_len, pages))),
            logits_rows=torch.from_numpy(np.concatenate([np.asarray(logits_rows, dtype=np.int64),
                                                         *prompt_logits_rows])).to(dev),
            page_size=self.ps,
        )
        return batch, sampled, prompt_rows
