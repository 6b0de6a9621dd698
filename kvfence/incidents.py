"""The incident log: one JSON line per isolation event, hash-chained, with no prompt or
completion text.

Every process that serves (single node, each PD node, the router) opens one at start
(`--incident-log PATH`, default `default_path()`), and the code that refuses something
calls `record()` in the same thread, before the request's error can reach its client: the
line is written, flushed and fsynced when `record()` returns.

A record says when, which process (role, boot id), what kind of event and which invariant,
which request and tenant asked, **which tenants' data was involved** (the ledger's owner of
the page or row that was touched, at that moment), which pages or rows, what the client got
(HTTP status, error code, tokens already streamed), and `prev`: the SHA-256 of the previous
line's bytes (the first line's is GENESIS). `verify()` walks the chain and says where it
breaks; a line edited, inserted or deleted before the last breaks it there. The chain has
no key: an edited last line, lines cut off the end or a file rewritten whole leave a valid
chain, so `last_hash` is in the isolation statement (and the console) for an operator to anchor
elsewhere, and `verify(expect_last_hash=...)` checks that the chain still passes through it.

Only counts, ids, names from the operator's configuration and the checks' own messages
(page numbers, epochs) go in; never text a client sent or the model wrote.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvfence.incidents")

GENESIS = "0" * 64
RECENT = 200   # records kept in memory for the console

# kind -> the invariant it is about, and how we know nothing computed over another tenant's
# data reached a client (the disclosure report quotes it)
KINDS: dict[str, tuple[str, str]] = {
    "ledger_refusal": ("I2/I3", "the ledger refused the read before the forward pass ran: no token of that pass "
                                "was computed, and the request ended with the tokens it had before"),
    "audit_violation": ("I2/I3", "the read audit saw the batch before the model ran it; the ledger's own check "
                                 "refuses the same reads (a record here means two checks disagreed)"),
    "transfer_verification_failed": ("I5", "decode authenticates pulled rows before anything is copied into its "
                                           "pool; rows that fail are never read by the model"),
    "fence_lifted_by_time": ("I6", "rows stayed quarantined until no transfer could still touch them; they were "
                                   "freed, not read, and a late write lands in a freed row that is zeroed on grant"),
    "node_refused": ("I8", "a refused node gets no request"),
    "faults_active": ("all", "test fault points were on at start-up: the guarantees do not hold for this process"),
    "faults_cleared": ("all", "the test fault points of the process before were off from here on"),
    "startup_check_failed": ("all", "the process did not start serving"),
}


@dataclass
class Verification:
    ok: bool
    records: int
    broken_at: int | None = None     # 1-based line number of the first bad line
    message: str = ""
    last_hash: str = GENESIS          # the hash the chain ends with (to compare with an anchored one)
    torn: tuple[int, ...] = ()        # lines cut short while being written (a crash, a full disk)


def default_path(role: str, port: int | None = None) -> Path:
    """$XDG_STATE_HOME/kvfence/incidents-ROLE[-PORT].jsonl (~/.local/state without it): one
    file per process, so that nodes sharing a machine never share a chain."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "kvfence"
    return base / (f"incidents-{role}-{port}.jsonl" if port else f"incidents-{role}.jsonl")


def _line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


MAX_TAIL = 1 << 20   # bytes read back from the end for the last record's hash


def _last_line(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            if end == 0:
                return None
            # chunks kept in a list and the read capped: prepending each 4 KiB to the rest was
            # quadratic (found in review: a 16 MB file without a newline took 11 s at start-up).
            # A record is a few KB; a longer last line is no record, and verify() says so
            pos, chunks, newlines = end, [], 0
            while pos > 0 and newlines < 2 and end - pos < MAX_TAIL:
                step = min(4096, pos)
                pos -= step
                f.seek(pos)
                chunks.append(f.read(step))
                newlines += chunks[-1].count(b"\n")
            lines = b"".join(reversed(chunks)).rstrip(b"\n").split(b"\n")
            return lines[-1] + b"\n"
    except FileNotFoundError:
        return None


def _ends_torn(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class IncidentLog:
    def __init__(self, path: str | Path, role: str, boot_id: str | None = None):
        self.path = Path(path)
        self.role = role
        self.boot_id = boot_id or uuid.uuid4().hex
        self.path.parent.mkdir(parents=True, exist_ok=True)
        last = _last_line(self.path)
        self.last_hash = _line_hash(last) if last else GENESIS
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if last is not None and _ends_torn(self.path):
            # the last process died in the middle of a line: end it, so that this boot's
            # records start on their own lines and chain from it (verify() names it torn)
            os.write(self._fd, b"\n")
            os.fsync(self._fd)
        self._lock = threading.Lock()
        self.written = 0
        self.recent: deque[dict] = deque(maxlen=RECENT)

    def record(self, kind: str, *, request_id: str | None = None, tenant: str | None = None,
               involved: Iterable[str] = (), pages: Iterable[int] = (), rows: Iterable[int] = (),
               client: dict | None = None, detail: str = "", invariant: str | None = None,
               other_party: bool = False) -> dict:
        if kind not in KINDS:
            raise ValueError(f"unknown incident kind {kind!r}")
        now = time.time()
        with self._lock:
            rec = {"time": dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="milliseconds"),
                   "unix": round(now, 3), "role": self.role, "boot_id": self.boot_id, "kind": kind,
                   "invariant": invariant or KINDS[kind][0], "request_id": request_id, "tenant": tenant,
                   "involved_tenants": sorted({t for t in involved if t}), "pages": sorted({int(p) for p in pages}),
                   "rows": sorted({int(r) for r in rows}), "client": client, "detail": detail[:1000],
                   # the data involved is another party's under the requester's own name (a
                   # retired tenant's, another router's): cross-tenant though the names match
                   **({"other_party": True} if other_party else {}),
                   "prev": self.last_hash}
            line = (json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()
            os.write(self._fd, line)
            os.fsync(self._fd)
            self.last_hash = _line_hash(line)
            self.written += 1
            self.recent.append(rec)
        log.warning("incident %s (%s) request=%s tenant=%s involved=%s", kind, rec["invariant"], request_id, tenant,
                    rec["involved_tenants"])
        return rec

    def describe(self) -> dict:
        return {"path": str(self.path), "records_this_boot": self.written, "last_hash": self.last_hash}

    def close(self) -> None:
        os.close(self._fd)


# -- the process's log -------------------------------------------------------------------------
_log: IncidentLog | None = None


def open_log(path: str | Path, role: str, boot_id: str | None = None, faults_on: bool = False) -> IncidentLog:
    """This process's log. `faults_on`: whether it runs with test fault points; if not and
    the log's last word on them is that they were on, the window that left open ends here
    (faults_cleared), else a report would find no end to it (found in review)."""
    global _log
    if _log is not None:
        _log.close()
    left_on = not faults_on and _faults_left_on(Path(path))
    _log = IncidentLog(path, role, boot_id)
    log.info("incident log: %s", _log.path)
    if left_on:
        _log.record("faults_cleared", detail="a process without test fault points opened this log")
    return _log


MAX_FAULT_TAIL = 1 << 20   # how far back a start looks for the log's last fault record


def _faults_left_on(path: Path) -> bool:
    """Whether the last faults_active / faults_cleared record in the log's last MAX_FAULT_TAIL
    bytes is faults_active. One further back is not looked for: a report then keeps that window
    open (cannot tell), the safe side. Only those lines are parsed: this runs at every start."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - MAX_FAULT_TAIL))
            data = f.read()
    except FileNotFoundError:
        return False
    on = False
    for line in data.split(b"\n"):
        rec = _record(line) if b'"kind":"faults_' in line else None   # written with sort_keys, no spaces
        if rec is not None and rec["kind"] in ("faults_active", "faults_cleared"):
            on = rec["kind"] == "faults_active"
    return on


def current() -> IncidentLog | None:
    return _log


def close_log() -> None:
    global _log
    if _log is not None:
        _log.close()
        _log = None


def record(kind: str, **fields) -> dict | None:
    """Append to this process's log (a no-op in a process that opened none: tests driving
    an engine directly, the simulation)."""
    return _log.record(kind, **fields) if _log is not None else None


def client_outcome(code: str | None, tokens_streamed: int) -> dict:
    """What the client of a refused request gets: the status the server maps `code` to."""
    from kvfence.server.errors import abort_status  # the server's one table of codes -> HTTP status
    status = abort_status(code)[0]
    return {"status": status, "code": code, "tokens_streamed": tokens_streamed}


# -- reading ---------------------------------------------------------------------------------------
def _record(line: bytes) -> dict | None:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):   # RecursionError: a line of 100,000 '['
        return None
    return rec if isinstance(rec, dict) else None


# every record's line begins so (its keys are sorted): a line cut short while being written
# begins so too, or is a piece of it; any other line that is not a record was put there
RECORD_START = b'{"boot_id":"'
# every field the report reads, and what it must hold (a JSON object that differs is no record
# of ours: a chained line without "time", or with a number for a tenant, crashed the report)
_STR, _OPT_STR, _NUM = (str,), (str, type(None)), (int, float)
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "unix": _NUM, "time": _STR, "kind": _STR, "invariant": _STR, "role": _STR, "boot_id": _STR, "prev": _STR,
    "tenant": _OPT_STR, "request_id": _OPT_STR, "detail": _STR, "client": (dict, type(None)),
    "involved_tenants": (list,), "pages": (list,), "rows": (list,)}
_ITEMS = {"involved_tenants": str, "pages": int, "rows": int}


def _cut_short(line: bytes) -> bool:
    t = line.rstrip(b"\n")
    return bool(t) and (RECORD_START.startswith(t) or t.startswith(RECORD_START))


def _not_ours(rec: dict) -> str | None:
    """Which field of a JSON object is missing or not what an incident record holds, or None."""
    for name, kinds in RECORD_FIELDS.items():
        v = rec.get(name)
        if name not in rec or not isinstance(v, kinds) or isinstance(v, bool):
            return name
        if isinstance(v, list) and not all(isinstance(x, _ITEMS[name]) and not isinstance(x, bool) for x in v):
            return name
    if not isinstance(rec.get("other_party", False), bool):
        return "other_party"
    return None


def read(path: str | Path, lines: int | None = None) -> Iterator[dict]:
    """The records of the first `lines` lines (all by default); a line that is not a record
    (a torn write, garbage) is skipped here: verify() is what judges the file."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if lines is not None and n > lines:
                return
            rec = _record(line) if line.strip() else None
            if rec is not None:
                yield rec


def verify(path: str | Path, expect_last_hash: str | None = None) -> Verification:
    """Walk the hash chain: every line's `prev` must be the hash of the line before it.

    Lines that are not records break the chain, except torn writes: a process stopped while
    writing (a crash loop leaves several in a row), and the next boot ended the line and
    chained on from it, so a run of them is torn when the first record after the run chains
    from its last line, or when nothing but them follows. The chain has no key, so whoever
    can rewrite the file can rewrite it whole; `expect_last_hash` (a last_hash the isolation
    statement or /metrics showed at some time, kept elsewhere) is what catches that, and
    lines cut off the end: the chain must pass through it. Records written after the anchor
    was taken are fine; an anchor the chain never reaches is a failure."""
    prev, records = GENESIS, 0
    torn: list[int] = []
    reached = {GENESIS: 0}          # hash after line n -> n: every point an anchor may name
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)

    def whole(line: bytes) -> bytes:
        return line if line.endswith(b"\n") else line + b"\n"

    n = 0
    while n < len(lines):
        rec = _record(lines[n])
        if rec is None:
            end = n                 # lines[n:end] are not records
            while end < len(lines) and _record(lines[end]) is None:
                if not _cut_short(lines[end]):
                    return Verification(False, records, end + 1, f"line {end + 1}: neither a JSON record nor one "
                                        "cut short while being written: it was put there (or this is not an "
                                        "incident log)", prev, tuple(torn))
                end += 1
            last = _line_hash(whole(lines[end - 1]))
            following = _record(lines[end]) if end < len(lines) else None
            if following is not None and following.get("prev") != last:
                span = f"line {n + 1}" if end == n + 1 else f"lines {n + 1}-{end}"
                return Verification(False, records, n + 1, f"{span}: not a JSON record, and the chain does not go "
                                                           f"on from it: a line was changed or inserted there", prev,
                                    tuple(torn))
            for k in range(n, end):
                torn.append(k + 1)
                reached[_line_hash(whole(lines[k]))] = k + 1
            prev, n = last, end
            continue
        if (missing := _not_ours(rec)) is not None:
            return Verification(False, records, n + 1, f"line {n + 1}: a JSON object but not an incident record (no "
                                                       f"valid '{missing}'): it was put there", prev, tuple(torn))
        if rec.get("prev") != prev:
            return Verification(False, records, n + 1, f"line {n + 1}: the chain breaks here (its prev does not match "
                                                       f"the hash of line {n}): a line was changed, inserted or "
                                                       f"removed at or before it", prev, tuple(torn))
        records += 1
        prev = _line_hash(whole(lines[n]))
        reached[prev] = n + 1
        n += 1
    anchor = ""
    if expect_last_hash is not None:
        want = expect_last_hash.strip().lower()
        if want not in reached:
            return Verification(False, records, len(lines) + 1,
                                f"{records} records chain, but the chain never reaches the expected hash {want} (it "
                                f"ends with {prev}): lines were cut off the end, or the file was rewritten", prev,
                                tuple(torn))
        at = reached[want]
        anchor = ("; the anchored hash is the end" if at == len(lines)
                  else f"; the anchored hash is that of line {at}, and {len(lines) - at} line(s) came after it")
    shown = ", ".join(map(str, torn[:10])) + (f" and {len(torn) - 10} more" if len(torn) > 10 else "")
    note = (f"; line(s) {shown} cut short while being written (a crash or a full disk): "
            "what they recorded is lost") if torn else ""
    return Verification(True, records, None, f"{records} records, chain intact; last hash {prev}{anchor}{note}",
                        prev, tuple(torn))
