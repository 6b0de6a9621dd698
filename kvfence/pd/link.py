"""What both ends of a handoff share: the transfer buffer, its registration, the boot id.

A PD link attaches itself to an engine (`engine.kv_link`) and implements the declared
boundary `kvfence.engine.kv_link.KvLink`: the engine asks it questions and applies the
decisions its hooks return; the link changes only its own rows, leases and pulls.
"""
from __future__ import annotations

import uuid
from collections import Counter

from kvfence import incidents
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
        # a restarted process is another node (I8 re-check, stale handles); the incident log says the same boot
        log = incidents.current()
        self.boot_id = log.boot_id if log is not None and log.role == settings.role else uuid.uuid4().hex
        self.counters: Counter[str] = Counter()
        self.role = settings.role
        self._fenced: dict[int, tuple[str, str]] = {}   # fenced request number -> (request id, tenant)
        self.staging.ledger.on_time_lift = self._lifted_by_time
        engine.kv_link = self

    def fence(self, seq: Sequence, owner, rows, reason: str, until: float) -> None:
        """Quarantine a request's rows until `until` (I6), remembering whose they were for
        the incident log in case the clock, not a proof, ends the fence."""
        led = self.staging.ledger
        self._fenced = {r: v for r, v in self._fenced.items() if led.fenced(r)}
        self._fenced[owner.request] = (seq.request_id, seq.tenant)
        led.fence(owner, rows, reason, until=until)
        self.counters["fences"] += 1

    def lift_fence_of(self, request_id: str) -> bool:
        """Word came after the fence was set (an ACK, or decode saying no read runs, after the
        lease had already ended): nothing can read the rows, so they are freed now rather than
        at the fence's deadline."""
        led = self.staging.ledger
        number = next((r for r, (rid, _) in self._fenced.items() if rid == request_id and led.fenced(r)), None)
        if number is None:
            return False
        del self._fenced[number]
        led.lift_fence(number)
        self.counters["fences_lifted_by_word"] += 1
        return True

    def _lifted_by_time(self, request: int, rows: list[int]) -> None:
        rid, tenant = self._fenced.pop(request, (None, None))
        peer = "decode" if self.role == "prefill" else "the transfer engine"
        incidents.record("fence_lifted_by_time", request_id=rid, tenant=tenant, involved=[tenant] if tenant else [],
                         rows=rows, detail=f"{self.role}: {len(rows)} transfer-buffer rows freed at their fence's "
                                           f"deadline, with no word from {peer} that nothing still touches them")

    def sealing_secret(self, m: Manifest) -> bytes | None:
        """The secret the manifest's key id names, among this node's own and those it accepts
        while the cluster rotates (None: decode cannot open these rows); a manifest without
        one (a prefill from before key ids) was sealed with the cluster's one secret."""
        secrets = self.settings.secrets   # one read: a reload between two would mix two sets
        if m.seal_key is None:
            return secrets.own
        return secrets.for_key(m.seal_key)

    @staticmethod
    def cipher(secret: bytes, m: Manifest, seq: Sequence) -> RowCipher:
        """The key of one hold's rows, from the cluster secret that seals or sealed them and this
        node's own knowledge of the request (decode has checked the manifest names the same)."""
        return RowCipher(secret, m.seal_salt, m.boot_id, seq.request_id, seq.tenant)

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
