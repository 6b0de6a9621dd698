"""What the operator console shows, as JSON (GET /v1/kvfence/console): the isolation
statement, the nodes and their checks, each node's KV pool by state, request and rejection
counters, and this process's incident records, newest first.

Counts, ids, states and names from the operator's configuration only: never a key, never
prompt or completion text (the snapshot and the incident records hold none to begin with).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvfence import incidents
from kvfence.server.errors import APIError

if TYPE_CHECKING:
    from kvfence.pd.fleet import Fleet, Node
    from kvfence.server.app import ServerState

INCIDENTS_SHOWN = 100
LOGS_NOTE = ("Each process (single node, each PD node, the router) keeps its own incident log; this page shows "
             "this process's records. `kvfence incidents LOG ...` merges the logs of every process into the "
             "disclosure report.")


def console_view(state: ServerState) -> dict[str, Any]:
    fleet = _fleet(state)
    try:
        statement: dict | None = state.statement()
        why = None
    except APIError as e:      # still loading, or failed: the rest of the page still says so
        statement, why = None, e.message
    if fleet is None and _is_router(state):   # still waiting for its nodes: itself alone, no pool yet
        role, nodes, pools = "router", [_local_node(state, "router")], []
    elif fleet is None:
        snap = state.engine.snapshot or {}
        role = "node" if snap.get("pd") else "single"
        nodes = [_local_node(state, role)]
        pools = [p for p in [pool_of("local", role, snap)] if p is not None]
    else:
        role = "router"
        sends = state.keyring.current.key_ids[0] if state.keyring is not None else None
        nodes = [_local_node(state, "router")] + [_fleet_node(n, sends) for n in fleet.nodes]
        # a node that is not ready keeps its last report: the page says so (its state)
        pools = [{**p, "node_state": n.state} for n in fleet.nodes if n.info is not None
                 for p in [pool_of(n.url, n.role, n.info.snapshot)] if p is not None]
    return {"generated_at": time.time(), "role": role, "served_model": _served(state),
            "isolation": statement, "isolation_unavailable": why, "nodes": nodes, "pools": pools,
            "requests": request_counters(state), "incidents": incidents_view(), "tenants": tenants_view(state)}


def tenants_view(state: ServerState) -> dict[str, Any]:
    """The tenants file in force and its last reload (names and counts, never a key)."""
    reg = state.tenants
    return {"file": reg.source, "configured": len(reg.tenants), "last_reload": state.last_reload,
            "last_good_reload": state.last_good_reload}


def _fleet(state: ServerState) -> Fleet | None:
    """The router's fleet; None on a single node (or a PD node, which has no fleet)."""
    from kvfence.pd.fleet import Fleet

    fleet = getattr(state.engine, "fleet", None)
    return fleet if isinstance(fleet, Fleet) else None


def _seals_with(ids: list[str]) -> str:
    """A node's key ids as /internal/info lists them: the one it seals with, then those it accepts."""
    return f"seals with key id {ids[0]}" + (f"; also accepts {', '.join(ids[1:])}" if ids[1:] else "")


def _is_router(state: ServerState) -> bool:
    """A PD router's state, its fleet up or not (its backend holds the keyring it sends with)."""
    return state.keyring is not None and getattr(state.engine, "keyring", None) is state.keyring


def _served(state: ServerState) -> str | None:
    try:
        return state.served_name
    except APIError:
        return None


def _local_node(state: ServerState, role: str) -> dict[str, Any]:
    snap = state.engine.snapshot or {}
    checks = [_check(c) for c in state.engine.startup_checks]
    if state.keyring is not None:   # a PD process: the secrets it holds now, by key id, and its last reload
        ids, last = state.keyring.current.key_ids, state.last_secret_reload
        detail = f"sends with key id {ids[0]}" if _is_router(state) else _seals_with(ids)
        if last is not None:
            when = time.strftime("%H:%M:%S", time.localtime(last["at"]))
            detail += (f"; reloaded at {when} ({last['trigger']})" if last["result"] == "ok" else
                       f"; the reload at {when} failed, the secrets before it stay: {last['error']}")
        checks.append({"name": "cluster secret", "invariant": "I11",
                       "status": "failed" if last is not None and last["result"] != "ok" else "info",
                       "detail": detail})
    return {"name": "router" if role == "router" else "local", "role": role, "url": None,
            "state": state.engine.state, "reason": state.engine.error, "running": snap.get("running"),
            "waiting": snap.get("waiting"), "checks": checks}


def _fleet_node(n: Node, router_sends: str | None = None) -> dict[str, Any]:
    d = n.to_json()
    info = n.info
    checks = [{"name": "capacity (router's check)", "invariant": "I8",
               "status": {"ready": "passed", "refused": "failed"}.get(n.state, n.state),
               "detail": n.reason or f"{n.state} since {time.strftime('%H:%M:%S', time.localtime(n.since))}"}]
    if info is not None:
        checks.append({"name": "read checks before every forward pass", "invariant": "I2, I3",
                       "status": "passed" if info.read_checks else "failed",
                       "detail": "on" if info.read_checks else "DISABLED on this node"})
        checks.append({"name": "scrub policy", "invariant": "I7", "status": "info", "detail": info.scrub})
        ids = info.secret_key_ids
        if ids:   # mid-rotation, what each node seals with and accepts; whether it takes this router's
            takes = router_sends is None or router_sends in ids
            checks.append({"name": "cluster secret", "invariant": "I11", "status": "passed" if takes else "failed",
                           "detail": _seals_with(ids) + (
                               "" if takes else f"; does not accept {router_sends}, the one this router sends")})
        sec = info.pd_security
        if sec is not None:
            checks.append({"name": "internal transport", "invariant": "I5", "status": "passed" if sec.tls else "info",
                           "detail": ("TLS" + (", client certificates" if sec.client_certificates_required else ""))
                           if sec.tls else "plaintext (private network)"})
    return {"name": n.url, "role": n.role, "url": n.url, "state": n.state, "reason": n.reason or None,
            "boot_id": d["boot_id"], "running": d["running"], "waiting": d["waiting"], "in_flight": n.in_flight,
            "routed": n.routed, "checks": checks}


def _check(c: dict) -> dict[str, Any]:
    return {k: c.get(k) for k in ("name", "invariant", "status", "detail")}


def pool_of(node: str, role: str, snap: dict | None) -> dict[str, Any] | None:
    """One node's KV pool by state, from its engine snapshot; quarantined and fenced are
    disjoint here (the snapshot's pages_quarantined counts both, as /metrics does)."""
    if not snap or "pages_total" not in snap:
        return None
    by = snap.get("pages_by_owner") or {}
    quarantined, fenced = int(snap.get("pages_quarantined", 0)), int(snap.get("pages_fenced", 0))
    pool: dict[str, Any] = {
        "node": node, "role": role, "pages_total": int(snap["pages_total"]), "free": int(snap.get("pages_free", 0)),
        "owned_total": int(snap.get("pages_owned", 0)), "shared_total": int(snap.get("pages_shared", 0)),
        "owned": {str(k): int(v) for k, v in (by.get("owned") or {}).items()},
        "shared": {str(k): int(v) for k, v in (by.get("shared") or {}).items()},
        "quarantined": max(0, quarantined - fenced), "fenced": fenced, "buffer": None}
    pd = snap.get("pd")
    if pd and "buffer_rows" in pd:
        rows, free, f = int(pd.get("buffer_rows", 0)), int(pd.get("buffer_free", 0)), int(pd.get("buffer_fenced", 0))
        pool["buffer"] = {"rows": rows, "free": free, "fenced": f, "held": max(0, rows - free - f)}
    return pool


# the per-tenant latency table: histogram name -> its column prefix
LATENCY_HISTOGRAMS = {"kvfence_time_to_first_token_seconds": "ttft", "kvfence_queue_wait_seconds": "queue"}


def request_counters(state: ServerState) -> dict[str, Any]:
    """Totals since start from this server's Prometheus counters (the page turns them into
    rates between refreshes), and each tenant's TTFT and wait to run at the median and p95.
    A router's retries by stage too: a node failing often shows there before any client sees
    an error (the retries hide it from them)."""
    by_outcome: dict[str, float] = {}
    by_tenant: dict[str, float] = {}
    rejections: dict[str, float] = {}
    retries: dict[str, float] = {}   # a router's: requests it sent to another node, by stage
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}   # (histogram, tenant) -> (le, count)
    for fam in state.metrics.registry.collect():
        for s in fam.samples:
            if s.name == "kvfence_requests_total":
                by_outcome[s.labels["outcome"]] = by_outcome.get(s.labels["outcome"], 0) + s.value
                by_tenant[s.labels["tenant"]] = by_tenant.get(s.labels["tenant"], 0) + s.value
            elif s.name == "kvfence_admission_rejections_total":
                rejections[s.labels["reason"]] = s.value
            elif s.name == "kvfence_pd_request_retries_total":
                retries[s.labels["stage"]] = s.value
            elif s.name.endswith("_bucket") and s.name[:-len("_bucket")] in LATENCY_HISTOGRAMS:
                key = (s.name[:-len("_bucket")], s.labels["tenant"])
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
    latency: dict[str, dict[str, float | None]] = {}
    for (name, tenant), bs in buckets.items():
        row = latency.setdefault(tenant, {})
        col = LATENCY_HISTOGRAMS[name]
        bs.sort()
        row[f"{col}_count"] = bs[-1][1]   # the +Inf bucket: every observation
        for q in (0.5, 0.95):
            row[f"{col}_p{round(q * 100)}"] = histogram_quantile(q, bs)
    return {"by_outcome": by_outcome, "by_tenant": by_tenant, "rejections": rejections, "latency": latency,
            "pd_retries": retries}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram [(upper bound, count)], sorted and ending at
    +Inf, by linear interpolation inside the bucket it falls in, as Prometheus's
    histogram_quantile does (the last finite bound when it falls in +Inf); None when empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower


def incidents_view(limit: int = INCIDENTS_SHOWN) -> dict[str, Any]:
    log = incidents.current()
    if log is None:
        return {"log": None, "records": [], "note": "this process opened no incident log. " + LOGS_NOTE}
    records = list(log.recent)   # one C-level copy: record() appends under the GIL, never mid-copy
    records.reverse()
    return {"log": log.describe(), "role": log.role, "boot_id": log.boot_id, "records": records[:limit],
            "note": LOGS_NOTE}
