"""The simulated transfer engine: the simulator, not a thread pool, decides when a pull runs
and what becomes of its completion notice.

`KvImporter` hands every pull to `self._workers.submit(self._pull, pull_id, manifest, rows)`.
The simulation puts a `SimWorkers` there, so a pull only queues here. Later the simulator:

- runs it (`run`), once its drawn duration has passed (most pulls are quick, some are slow:
  up to the hard timeout, so decode gives up on them and a fence must cover them): the byte
  copy is InProcessTransport's one-sided read from the prefill node's transfer buffer into
  the decode node's, exactly what the real pull does, under a fate drawn when it was
  submitted: ok, fail (nothing copied), partial (some rows, then a failure), corrupt (all
  rows, one byte flipped), short_ok (a lying transport: some rows missing, success
  reported), cut (the transfer engine's hard timeout);
- queues its notice, which it may deliver later, in any order with other notices, twice,
  or never (`deliver`).

A pull counts as in flight, and may still write its destination rows and read its source
rows, until it has run. The transfer engine's hard timeout is a promise the protocol
relies on (docs/pd.md): a pull runs, at the latest, `max_pull_s` after it was submitted,
and `SimTransport.due()` lets the simulator honour it before its clock passes that point.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvfence.kv.pool import k_element
from kvfence.pd.messages import Handoff, Manifest

PULL_FATES = ("ok", "fail", "partial", "corrupt", "short_ok", "cut")
NOTICE_FATES = ("deliver", "drop", "duplicate")
FAILING_FATES = frozenset({"fail", "partial", "corrupt", "short_ok", "cut"})  # the request must not succeed


@dataclass
class SimPull:
    pull_id: int
    importer: object            # the KvImporter (one node boot) that submitted it
    manifest: Manifest
    handoff: Handoff            # the manifest and the source decode pulls from
    rows: list[int]             # decode transfer-buffer rows it writes
    request_id: str
    submitted: float            # true (simulator) time
    hard_deadline: float        # true time by which it has run (the transfer engine's timeout)
    fate: str
    notice_fate: str
    not_before: float = 0.0     # true time before which it cannot have finished (a slow transfer)
    ran: bool = False
    error: str | None = None
    pull: object = None         # the importer's Pull record (begin_read looks at it)


@dataclass
class SimNotice:
    importer: object
    pull_id: int
    request_id: str
    notice: tuple               # what KvImporter._pull would put on importer.notices


class SimWorkers:
    """Stands in for KvImporter._workers (a ThreadPoolExecutor): submit() only queues."""

    def __init__(self, transport: SimTransport, importer):
        self.transport = transport
        self.importer = importer

    def submit(self, fn, *args):
        pull, handoff = args
        self.transport.enqueue(self.importer, pull, handoff)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class SimTransport:
    def __init__(self, sim):
        self.sim = sim
        self.pending: list[SimPull] = []    # submitted, not yet run: in flight
        self.notices: list[SimNotice] = []  # run, notice not yet delivered
        self.counters = {f: 0 for f in PULL_FATES + NOTICE_FATES + ("not_begun",)}

    def enqueue(self, importer, pull, h: Handoff) -> None:
        sim = self.sim
        fate = sim.draw_fate()
        nfate = sim.draw_notice_fate()
        m = h.manifest
        p = SimPull(pull.pull_id, importer, m, h, list(pull.rows.pages), m.request_id, sim.now,
                    sim.now + sim.settings.max_pull_s, fate, nfate, sim.now + sim.draw_pull_duration(), pull=pull)
        self.pending.append(p)
        sim.on_pull_submitted(p)

    def ready(self, now: float) -> list[SimPull]:
        """Pulls the simulator may run now."""
        return [p for p in self.pending if p.not_before <= now]

    def due(self, until: float) -> list[SimPull]:
        """Pulls whose hard deadline falls at or before `until` (true time)."""
        return [p for p in self.pending if p.hard_deadline <= until]

    def forget_importer(self, importer) -> int:
        """A crashed decode process: its pulls die with it (no write, no notice)."""
        before = len(self.pending) + len(self.notices)
        self.pending = [p for p in self.pending if p.importer is not importer]
        self.notices = [n for n in self.notices if n.importer is not importer]
        return before - len(self.pending) - len(self.notices)

    def run(self, p: SimPull, rng) -> None:
        """The pull's one-sided read, under its fate; then its notice goes in the queue."""
        self.pending.remove(p)
        p.ran = True
        imp, m = p.importer, p.manifest
        refused = imp.begin_read(p.pull, m)   # what KvImporter._pull asks before its read
        if refused is not None:
            self.counters["not_begun"] += 1
            p.error = refused
            self.notices.append(SimNotice(imp, p.pull_id, p.request_id, (p.pull_id, False, refused, 0, 0.0)))
            return
        n = len(p.rows)
        self.counters[p.fate] += 1
        copy = {"ok": n, "corrupt": n, "fail": 0, "cut": 0,
                "partial": rng.randrange(0, n) if n > 1 else 0,
                "short_ok": rng.randrange(0, n) if n > 1 else 0}[p.fate]
        # which rows the transport actually moves (short_ok: a random strict subset)
        idx = list(range(n))
        if p.fate == "short_ok":
            rng.shuffle(idx)
        idx = sorted(idx[:copy])
        ok = p.fate in ("ok", "corrupt", "short_ok")
        error = None if ok else {"fail": "TransferError: sim: the peer refused the read",
                                 "partial": "TransferError: sim: the connection dropped mid-transfer",
                                 "cut": "TransferError: sim: the transfer engine's timeout cut the read"}[p.fate]
        nbytes = 0
        if idx:
            try:
                rows = [p.rows[i] for i in idx]
                nbytes = imp.transport.read(p.handoff.source.session, imp.staging.row_addresses(rows),
                                            p.handoff.source.row_addresses(m, idx),
                                            [m.slot_bytes] * len(idx))
            except Exception as e:  # noqa: BLE001 - the real _pull turns any failure into a failed notice
                ok, error, nbytes = False, f"{type(e).__name__}: {e}", 0
        if ok and p.fate == "corrupt":
            r = p.rows[rng.randrange(n)]
            if rng.random() < 0.3:   # a byte of the tag
                off = imp.staging.slot_bytes - 1 - rng.randrange(0, 16)
            else:                    # a byte of slot 0's keys, layer 0, head 0: always a live token
                ps, dim = imp.staging.page_shape[-2:]
                elem = imp.staging.pool.kv.element_size()
                off = elem * k_element(rng.randrange(0, dim), 0, ps)
            imp.staging.buf[r, off] ^= 0x5A
        p.error = error
        notice = (p.pull_id, ok, error, nbytes, 0.0)
        self.counters[p.notice_fate] += 1
        copies = {"deliver": 1, "drop": 0, "duplicate": 2}[p.notice_fate]
        for _ in range(copies):
            self.notices.append(SimNotice(imp, p.pull_id, p.request_id, notice))

    def deliver(self, n: SimNotice) -> None:
        self.notices.remove(n)
        n.importer.notices.put(n.notice)
        n.importer.engine.wake()
