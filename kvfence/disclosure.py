"""The disclosure report: one or many processes' incident logs (kvfence/incidents.py) turned
into what an operator owes its customers.

    kvfence incidents [LOG ...] [--since T] [--until T] [--tenant NAME] [--json] [--tenants FILE]
    kvfence incidents --verify [LOG ...]

Per tenant: the requests affected, as the requester and as the owner of data a refused read
or transfer pointed at, and the time window; for every event that involved another tenant's
data, whether any byte computed over it reached a client, and how the log shows it. The
operator's commitments ([disclosure] in the tenants file) head the report. Every log's hash
chain is verified first; a broken chain is reported, never silently skipped.
"""
from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable
from pathlib import Path

from kvfence import incidents
from kvfence.kv.ledger import scope_label


def parse_time(text: str) -> float:
    """ISO 8601 (a date, or a date and time; UTC unless it says otherwise) or Unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give ISO 8601 (2026-12-01T10:00Z) or Unix seconds") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def default_logs() -> list[Path]:
    return sorted(incidents.default_path("x").parent.glob("incidents-*.jsonl"))


def _reached_client(rec: dict) -> tuple[bool, str]:
    """Did bytes computed over the involved data reach the client? Only a 200 could carry
    them; every kind says why the refused data was never computed over."""
    client = rec.get("client") or {}
    how = incidents.KINDS.get(rec["kind"], ("", "unknown kind"))[1]
    if client.get("status") == 200:
        return True, "the client got a 200 for a request whose read or transfer was refused: investigate"
    got = (f"the client got {client.get('status')} {client.get('code')} after {client.get('tokens_streamed', 0)} "
           f"token(s) computed before the refusal" if client else "no client was answered from this event")
    return False, f"{how}; {got}"


def build(paths: Iterable[str | Path], since: float | None = None, until: float | None = None,
          tenant: str | None = None, disclosure: dict | None = None, expect_last_hash: str | None = None) -> dict:
    chains, records, unguarded = [], [], []
    for p in paths:
        v = incidents.verify(p, expect_last_hash)
        chains.append({"log": str(p), "intact": v.ok, "records": v.records, "broken_at_line": v.broken_at,
                       "torn_lines": list(v.torn), "last_hash": v.last_hash, "message": v.message})
        # a broken log: only the records before the break can be trusted
        every = list(incidents.read(p, None if v.broken_at is None else v.broken_at - 1))
        unguarded += _unguarded(p, every, since, until)
        for rec in every:
            if (since is None or rec["unix"] >= since) and (until is None or rec["unix"] <= until):
                # logs written before public scopes were named "public:NAME" hold the ledger's
                # raw key ("\0public:NAME")
                if rec.get("tenant"):
                    rec["tenant"] = scope_label(rec["tenant"])
                rec["involved_tenants"] = [scope_label(t) for t in rec.get("involved_tenants") or ()]
                records.append(rec)
    records.sort(key=lambda r: r["unix"])
    tenants: dict[str, dict] = {}

    def entry(name: str) -> dict:
        # a page of a public prefix scope holds data every tenant of that scope may read: named
        # "public:NAME" (a tenant name cannot hold ':'), reported as the scope, not as a tenant
        kind = "public_prefix_scope" if name.startswith("public:") else "tenant"
        return tenants.setdefault(name, {"kind": kind, "as_requester": set(), "as_owner": set(), "first": None,
                                         "last": None, "events": 0, "cross_tenant_events": 0,
                                         "bytes_reached_a_client": False})

    cross = []
    for rec in records:
        names = ({rec["tenant"]} if rec.get("tenant") else set()) | set(rec.get("involved_tenants") or ())
        for name in names:
            e = entry(name)
            e["events"] += 1
            e["first"] = e["first"] or rec["time"]
            e["last"] = rec["time"]
            rid = rec.get("request_id") or f"({rec['kind']})"
            if name == rec.get("tenant"):
                e["as_requester"].add(rid)
            if name in (rec.get("involved_tenants") or ()):
                e["as_owner"].add(rid)
        others = set(rec.get("involved_tenants") or ())
        if not rec.get("other_party"):   # else the requester's name, but another party's data
            others -= {rec.get("tenant")}
        if others and rec.get("tenant"):
            reached, how = _reached_client(rec)
            cross.append({"time": rec["time"], "kind": rec["kind"], "invariant": rec["invariant"],
                          "request_id": rec.get("request_id"), "requester": rec.get("tenant"),
                          "data_of": sorted(others), "role": rec["role"], "pages": rec.get("pages"),
                          "same_name_other_party": bool(rec.get("other_party")),
                          "rows": rec.get("rows"), "reached_client": reached, "how_we_know": how})
            for name in others | {rec["tenant"]}:
                entry(name)["cross_tenant_events"] += 1
                entry(name)["bytes_reached_a_client"] |= reached
    if tenant is not None:
        tenants = {k: v for k, v in tenants.items() if k == tenant}
        cross = [c for c in cross if tenant == c["requester"] or tenant in c["data_of"]]
        records = [r for r in records if tenant == r.get("tenant") or tenant in r["involved_tenants"]]
    process = [{k: r.get(k) for k in ("time", "kind", "invariant", "role", "boot_id", "detail")}
               for r in records if not r.get("tenant") and not r.get("involved_tenants")]
    any_reached = any(c["reached_client"] for c in cross)
    intact = all(c["intact"] for c in chains)
    torn = sum(len(c["torn_lines"]) for c in chains)
    # a broken chain or a torn line may have lost the very record that says yes, and a process
    # with test fault points on may have skipped the very check that records it: then the logs
    # cannot say no
    answer = "yes" if any_reached else "no" if intact and not torn and not unguarded else "cannot tell"
    if answer == "yes":
        how = "an event marked YES above gave its client a 200 for a request whose read or transfer was refused"
    else:
        how = ("every cross-tenant event above names what the client got and why the refused data was never "
               "computed over")
    return {
        "disclosure": {"contact": (disclosure or {}).get("contact"),
                       "postmortems_published_at": (disclosure or {}).get("postmortems"),
                       "notification_window_hours": (disclosure or {}).get("notification_window_hours")},
        "window": {"since": since, "until": until, "first_event": records[0]["time"] if records else None,
                   "last_event": records[-1]["time"] if records else None},
        "logs": chains,
        "events": len(records),
        "tenants": {k: {**v, "as_requester": sorted(v["as_requester"]), "as_owner": sorted(v["as_owner"])}
                    for k, v in sorted(tenants.items())},
        "cross_tenant": cross,
        "process_events": process if tenant is None else [],
        "unguarded": unguarded,
        "answer": {"any_byte_computed_over_another_tenants_data_reached_a_client": answer,
                   "how_we_know": (how + "; the logs' hash chains are "
                                   + ("intact" if intact else "BROKEN (see logs): records may be missing, so an "
                                      "answer of no cannot be given")
                                   + (f"; {torn} line(s) were cut short while being written, and what they "
                                      "recorded is lost" if torn else "")
                                   + (f"; {len(unguarded)} process(es) ran in this window with test fault points "
                                      "on, which may skip the checks that write these records (see unguarded)"
                                      if unguarded else ""))},
    }


def _skips_a_check(detail: str) -> bool:
    """Whether a faults_active record names a fault that gets past a defense (faults.SKIPS_A_CHECK)."""
    from kvfence.faults import SKIPS_A_CHECK

    named = set(re.findall(r"[a-z_]+", detail))
    return bool(named & SKIPS_A_CHECK)


def _unguarded(path: str | Path, every: list[dict], since: float | None, until: float | None) -> list[dict]:
    """The processes of one log that ran in the window with test fault points on. A process is
    taken to run from its faults_active record until the log's next record of another boot (or
    on), which can only overstate it; its events may be missing, since a fault such as
    skip_watermark skips the check that writes them (found by a docs probe: the report said no)."""
    out = []
    for i, rec in enumerate(every):
        if rec["kind"] != "faults_active" or not _skips_a_check(rec.get("detail") or ""):
            continue
        end = next((r["unix"] for r in every[i + 1:]
                    if r.get("boot_id") != rec.get("boot_id") or r["kind"] == "faults_cleared"), None)
        if (until is None or rec["unix"] <= until) and (since is None or end is None or end >= since):
            out.append({"log": str(path), "time": rec["time"], "role": rec.get("role"),
                        "boot_id": rec.get("boot_id"), "detail": rec.get("detail")})
    return out


def render(rep: dict) -> str:
    d = rep["disclosure"]
    lines = ["kvfence incident disclosure report", ""]
    lines.append(f"  contact:                {d['contact'] or '(not configured: [disclosure] in the tenants file)'}")
    lines.append(f"  postmortems published:  {d['postmortems_published_at'] or '(not configured)'}")
    w = d["notification_window_hours"]
    lines.append(f"  notification window:    {str(w) + ' hours' if w else '(not configured)'}")
    win = rep["window"]
    lines += ["", f"events: {rep['events']} (first {win['first_event'] or '-'}, last {win['last_event'] or '-'})"]
    for c in rep["logs"]:
        lines.append(f"  log {c['log']}: {'' if c['intact'] else 'CHAIN BROKEN: '}{c['message']}")
    # with records lost, no tenant's "no" can be given either
    unknown = "cannot tell" if rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == \
        "cannot tell" else None
    lines += ["", "per tenant:"]
    if not rep["tenants"]:
        lines.append("  (no tenant was involved in any event)")
    for name, t in rep["tenants"].items():
        shown = (f"public prefix scope {name.removeprefix('public:')} (prompt prefixes its tenants share)"
                 if t["kind"] == "public_prefix_scope" else name)
        lines.append(f"  {shown}: {t['events']} event(s) {t['first']} .. {t['last']}; as requester: "
                     f"{len(t['as_requester'])} request(s); as owner of touched data: {len(t['as_owner'])} "
                     f"request(s); cross-tenant: {t['cross_tenant_events']}; bytes reached a client: "
                     f"{'YES' if t['bytes_reached_a_client'] else unknown or 'no'}")
        for rid in t["as_requester"]:
            lines.append(f"      requested {rid}")
        for rid in t["as_owner"]:
            lines.append(f"      its data was involved in {rid}")
    if rep["cross_tenant"]:
        lines += ["", "events that involved another tenant's data:"]
        for c in rep["cross_tenant"]:
            lines.append(f"  {c['time']} {c['kind']} ({c['invariant']}) {c['request_id']} of {c['requester']} -> "
                         f"data of {', '.join(c['data_of'])}"
                         f"{' (another party under the same name)' if c.get('same_name_other_party') else ''}"
                         f" on {c['role']}: reached a client: "
                         f"{'YES' if c['reached_client'] else 'no'} ({c['how_we_know']})")
    if rep["unguarded"]:
        lines += ["", "processes with test fault points on in this window (their checks may not have run):"]
        for u in rep["unguarded"]:
            lines.append(f"  {u['time']} {u['role']} boot {u['boot_id']} ({u['log']}): {u['detail']}")
    if rep["process_events"]:
        lines += ["", "process events (no tenant involved):"]
        for p in rep["process_events"]:
            lines.append(f"  {p['time']} {p['kind']} ({p['invariant']}) on {p['role']}: {p['detail']}")
    a = rep["answer"]
    lines += ["", f"Did any byte computed over another tenant's data reach a client? "
                  f"{a['any_byte_computed_over_another_tenants_data_reached_a_client']}", f"  {a['how_we_know']}"]
    # a record's detail may quote what a peer sent (a refused node's dtype, say): a newline in
    # it printed a made-up answer line, an escape sequence hid the real one (found in review)
    return "\n".join(_printable(line) for line in lines)


def _printable(line: str) -> str:
    """The line with every character that is not printable written as its escape."""
    return line if line.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def main(a) -> int:
    """`kvfence incidents`: exit 0 when every chain is intact and nothing reached a client; 1
    when something did, or a chain is broken; 3 when the logs cannot tell (lines cut short
    while being written: what they recorded is lost)."""
    paths = [Path(p) for p in a.logs] or default_logs()
    if not paths:
        print(f"no incident logs given and none under {incidents.default_path('x').parent}")
        return 2
    if a.expect_last_hash is not None and len(paths) != 1:
        print("--expect-last-hash checks one log: name it")
        return 2
    if a.verify:
        bad = 0
        for p in paths:
            v = incidents.verify(p, a.expect_last_hash)
            print(f"{p}: {'ok' if v.ok else 'BROKEN'}: {v.message}")
            bad += not v.ok
        return 1 if bad else 0
    disclosure = {}
    if a.tenants:
        from kvfence.server.tenants import TenantRegistry
        registry = TenantRegistry.from_file(a.tenants)
        disclosure = registry.disclosure
        known = set(registry.tenants) | {f"public:{t.public_prefix_scope}" for t in registry.tenants.values()
                                         if t.public_prefix_scope}
    rep = build(paths, parse_time(a.since) if a.since else None, parse_time(a.until) if a.until else None,
                a.tenant, disclosure, a.expect_last_hash)
    if a.tenant is not None and a.tenants and a.tenant not in known and not rep["tenants"]:
        print(f"--tenant {a.tenant}: no such tenant in {a.tenants} and in no record (a misspelt name would "
              "report nothing)")
        return 2
    print(json.dumps(rep, indent=2) if a.json else render(rep))
    if a.tenant is not None and not rep["tenants"] and not a.json:
        print(f"  ({a.tenant} appears in no record: nothing happened to it, or the name is misspelt; "
              "--tenants FILE checks the name)")
    broken = not all(c["intact"] for c in rep["logs"])
    answer = rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"]
    return 1 if broken or answer == "yes" else 3 if answer == "cannot tell" else 0
