"""What both ends of a handoff share: the transfer buffer, its registration, the boot id.

A PD link attaches itself to an engine (`engine.kv_link`) and implements the declared
boundary `kvfence.engine.kv_link.KvLink`: the engine asks it questions and applies the
decisions its hooks return; the link changes only its own rows, leases and pulls.
"""
from __future__ import annotations

import uuid
from collections import Counter

from kvfence.engine.admission import CapacityError
from kvfence.engine.kv_link import KvLinkBase
from kvfence.engine.sequence import Sequence
from kvfence.pd.messages import Manifest
from kvfence.pd.seal import RowCipher
from kvfence.pd.settings import PDSettings
from kvfence.pd.staging import StagingBuffer


class PdLink(KvLinkBase):
    """The part of a KvLink that prefill and decode share; the defaults are the hooks a
    role does not use."""

    def __init__(self, engine, settings: PDSettings, transport):
        self.engine = engine
        self.settings = settings
        self.transport = transport
        rows = settings.transfer_buffer_pages or engine.ledger.usable_pages
        self.staging = StagingBuffer(engine.pool, rows)
        need = engine.ledger.pages_for(engine.usable_context)
        if self.staging.capacity_pages < need:
            raise CapacityError(f"the transfer buffer holds {self.staging.capacity_pages} pages, a full context "
                                f"of {engine.usable_context} tokens needs {need}")
        self.base = transport.register(self.staging.buf)
        self.boot_id = uuid.uuid4().hex  # a restarted process is another node (I8 re-check, stale handles)
        self.counters: Counter[str] = Counter()
        self.role = settings.role
        engine.kv_link = self

    def cipher(self, m: Manifest, seq: Sequence) -> RowCipher:
        """The key of one hold's rows, from the cluster secret and this node's own knowledge
        of the request (decode has checked the manifest names the same)."""
        assert self.settings.cluster_secret is not None  # PDSettings refuses to exist without it
        return RowCipher(self.settings.cluster_secret, m.seal_salt, m.boot_id, seq.request_id, seq.tenant)

    def facts(self) -> dict:
        """What the router's capacity check (I8) and handoffs need to know about this node."""
        s = self.settings
        return {"role": s.role, "boot_id": self.boot_id, "transfer_session": self.transport.session_id,
                "buffer_base": self.base,
                "kv_layout": self.staging.layout, "slot_bytes": self.staging.slot_bytes,
                "buffer_rows": self.staging.capacity_pages, "lease_s": s.lease_s, "max_pull_s": s.max_pull_s,
                "clock_skew_s": s.clock_skew_s}

    def buffer_stats(self) -> dict:
        led = self.staging.ledger
        return {"role": self.settings.role, "buffer_rows": led.usable_pages, "buffer_free": led.num_free,
                "buffer_fenced": led.num_quarantined, **{f"pd_{k}": v for k, v in self.counters.items()}}
