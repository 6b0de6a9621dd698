"""Prometheus metrics at /metrics.

Request-side numbers (outcomes, tokens, latencies, admission rejections) are recorded by
the HTTP handlers. Engine-side numbers (running/waiting, KV pages, isolation violations,
preemptions) are read at scrape time from the snapshot the engine thread publishes, so a
scrape never touches the engine. Each server has its own registry (several servers can
live in one process, as in the tests).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvfence import faults
from kvfence.server.errors import ABORT_STATUS, INTERNAL_ERROR
from kvfence.server.http_limits import REFUSAL_REASONS, ConnectionRefusals

if TYPE_CHECKING:
    from kvfence.pd.seal import Keyring

REJECTION_REASONS = ("context_length_exceeded", "tenant_max_prompt_tokens", "tenant_max_concurrent_requests",
                     "tenant_tokens_per_minute", "tenant_requests_per_minute", "invalid_request", "unauthorized",
                     "model_not_found", "not_ready", "server_overloaded")
INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, engine_loop):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvfence_requests", "Finished API requests by tenant and outcome "
                                "(stop, length, client_disconnected, error, rejected, invalid, unauthorized, "
                                "rate_limited, not_ready, key_revoked)", ["tenant", "outcome"], registry=r)
        self.tenant_reloads = Counter("kvfence_tenants_reloads", "Reloads of the tenants file (SIGHUP or POST "
                                      "/v1/kvfence/tenants/reload) by result: ok, or error (the previous file "
                                      "stays in force)", ["result"], registry=r)
        self.secret_reloads = Counter("kvfence_cluster_secret_reloads", "PD processes: reloads of the cluster "
                                      "secret files (SIGHUP) by result: ok, or error (the previous secrets stay "
                                      "in force)", ["result"], registry=r)
        for result in ("ok", "error"):
            self.tenant_reloads.labels(result)
            self.secret_reloads.labels(result)
        self.prompt_tokens = Counter("kvfence_prompt_tokens", "Prompt tokens admitted", ["tenant"], registry=r)
        self.generation_tokens = Counter(
            "kvfence_generation_tokens", "Tokens generated that reached the client (a failed unstreamed answer's "
            "did not)", ["tenant"], registry=r)
        # by tenant: whether one tenant waits while another is served is the question an operator
        # of a shared server asks first (the names come from the tenants file, so they are few)
        self.ttft = Histogram("kvfence_time_to_first_token_seconds", "From request arrival to the first token, "
                              "by tenant", ["tenant"], buckets=_LATENCY, registry=r)
        self.itl = Histogram("kvfence_inter_token_latency_seconds", "Between consecutive tokens of a request, "
                             "by tenant", ["tenant"], buckets=_LATENCY, registry=r)
        self.duration = Histogram("kvfence_request_duration_seconds", "From arrival to the last token, by tenant",
                                  ["tenant"], buckets=_LATENCY, registry=r)
        # TTFT is this wait plus the prompt's compute: which of the two grew, when one tenant's
        # first tokens slow down, is what says whether it waited behind others
        self.queue = Histogram("kvfence_queue_wait_seconds", "From arrival to the request's first engine step "
                               "(parsing, tokenizing and the wait for a running slot; behind a PD router, the first "
                               "step on its prefill node), by tenant, for the answers the TTFT histogram counts "
                               "(behind a router, not a one-token prompt: it has no prefill)", ["tenant"],
                               buckets=_LATENCY, registry=r)
        self.rejections = Counter("kvfence_admission_rejections", "Requests refused before reaching the engine's "
                                  "scheduler, by reason", ["reason"], registry=r)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        # outcome="error" says that the server failed a request, this says how (a PD node lost, a
        # transfer that failed, ...): what an operator looks at when errors rise
        self.failures = Counter("kvfence_request_failures", "Requests the server failed after taking them (the "
                                "outcome error), by their error code", ["code"], registry=r)
        for code, (status, _) in ABORT_STATUS.items():
            if status >= 500:
                self.failures.labels(code)
        self.failures.labels(INTERNAL_ERROR)
        r.register(_EngineCollector(engine_loop))
        self.connections = ConnectionRefusals()   # the HTTP server counts what it closes here (uvicorn_server)
        r.register(_RefusalCollector(self.connections))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, tenant: str, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                 arrival: float | None = None, first_token_at: float | None = None,
                 token_times: Sequence[Sequence[float]] = (), started_at: float | None = None) -> None:
        """One request's end. `completion_tokens`, `first_token_at` and `token_times` (each
        choice's own) only for tokens that reached the client: _Run.close passes none for an
        unstreamed answer that failed. `started_at`: its first engine step; its wait to run is
        counted with its TTFT (the same answers), so the two compare."""
        self.requests.labels(tenant, outcome).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.labels(tenant).inc(completion_tokens)
        if arrival is not None and first_token_at is not None:
            self.ttft.labels(tenant).observe(max(0.0, first_token_at - arrival))
            if started_at is not None:
                self.queue.labels(tenant).observe(max(0.0, min(started_at, first_token_at) - arrival))
        itl = self.itl.labels(tenant)
        for times in token_times:   # per choice: n=2's merged times halved every gap
            for a, b in zip(times, times[1:]):
                itl.observe(b - a)
        last = max((times[-1] for times in token_times if times), default=None)
        if arrival is not None and last is not None:
            self.duration.labels(tenant).observe(max(0.0, last - arrival))


class KeyringCollector:
    """PD processes: the key ids of the cluster secrets held now (pd/seal.py), so a dashboard
    over the fleet shows which step of a rotation each process has reached. Key ids name
    secrets without revealing them; a process that is not a PD one has none."""

    def __init__(self, keyring: Callable[[], Keyring | None]):
        self.keyring = keyring

    def describe(self):
        return []

    def collect(self):
        ring = self.keyring()
        if ring is None:
            return
        g = GaugeMetricFamily("kvfence_cluster_secret_key", "PD processes: 1 for each cluster secret held now, by "
                              "key id and use (own: sends the credential and seals rows with it; accepted: also "
                              "taken while the cluster rotates)", labels=["key_id", "use"])
        ids = ring.current.key_ids
        g.add_metric([ids[0], "own"], 1.0)
        for k in ids[1:]:
            g.add_metric([k, "accepted"], 1.0)
        yield g


class _RefusalCollector:
    def __init__(self, refusals: ConnectionRefusals):
        self.refusals = refusals

    def describe(self):
        return []

    def collect(self):
        c = CounterMetricFamily("kvfence_http_connections_refused", "Connections closed without being served: "
                                "over the per-address cap, headers or body not received in time, an answer "
                                "the client took none of within the send timeout (reset), over the cap "
                                "of TLS handshakes in progress, or a TLS handshake that failed (no client "
                                "certificate, not TLS) or took too long",
                                labels=["reason"])
        for reason in REFUSAL_REASONS:
            c.add_metric([reason], float(self.refusals.counts[reason]))
        yield c


class _EngineCollector:
    def __init__(self, engine_loop):
        self.loop = engine_loop

    def describe(self):
        return []   # collected at scrape time; nothing to check at registration

    def collect(self):
        s = self.loop.snapshot or {}
        ready = GaugeMetricFamily("kvfence_engine_ready", "1 when the engine accepts requests")
        ready.add_metric([], 1.0 if self.loop.state == "ready" else 0.0)
        yield ready
        facts = self.loop.facts
        if facts is not None and "kernels" in facts:   # a process that runs the model (a PD router runs none)
            info = GaugeMetricFamily("kvfence_engine_info", "1, labelled with what runs the model: kernels loaded, "
                                     "off (chosen), unsupported (device, dtype) or unavailable (asked for, not "
                                     "built or loaded: the start's log says why; plain torch ops, several times "
                                     "slower)", labels=["model", "dtype", "weights", "device", "compute", "matmul",
                                                        "kernels"])
            info.add_metric([str(facts[k]) for k in ("model_name", "dtype", "weights", "device", "compute", "matmul",
                                                     "kernels")], 1.0)
            yield info
        on = faults.enabled()
        fi = GaugeMetricFamily("kvfence_fault_injection_active", "1 when any test-only fault point is enabled "
                               "(KVFENCE_TEST_FAULTS): the server is deliberately broken")
        fi.add_metric([], 1.0 if on else 0.0)
        yield fi
        if on:
            each = GaugeMetricFamily("kvfence_fault_injection_enabled", "Enabled test-only fault points",
                                     labels=["fault"])
            for name in sorted(on):
                each.add_metric([name], 1.0)
            yield each
        # the engine's sequences: a request of n choices (or a list of prompts) counts each (probe)
        for name, key, doc in (("kvfence_requests_running", "running",
                                "Sequences holding KV pages (each choice of a request counts)"),
                               ("kvfence_requests_waiting", "waiting",
                                "Admitted sequences queued for pages (each choice of a request counts)")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(s.get(key, 0)))
            yield g
        if "sequences_by_tenant" in s:   # an engine's own, or a PD router's requests in flight
            by = GaugeMetricFamily("kvfence_tenant_sequences", "Sequences running and waiting, by tenant: whether "
                                   "one tenant holds the running slots while another waits (a tenant with none "
                                   "is not listed); on a PD router, requests generating (their KV reached "
                                   "decode) and those not yet (in prefill, waiting for transfer rows or for "
                                   "decode's pages)",
                                   labels=["tenant", "state"])
            for tenant, counts in sorted(s["sequences_by_tenant"].items()):
                for state in ("running", "waiting"):
                    by.add_metric([tenant, state], float(counts[state]))
            yield by
        pages = GaugeMetricFamily("kvfence_kv_pages", "KV pages by state (used: owned by a running request; "
                                  "shared: tenant-scoped prefix cache, read-only); on a PD router, summed over "
                                  "every ready node, prefill and decode", labels=["state"])
        pages.add_metric(["used"], float(s.get("pages_owned", 0)))
        pages.add_metric(["free"], float(s.get("pages_free", 0)))
        pages.add_metric(["shared"], float(s.get("pages_shared", 0)))
        pages.add_metric(["quarantined"], float(s.get("pages_quarantined", 0)))
        yield pages
        total = GaugeMetricFamily("kvfence_kv_pages_total", "Usable KV pages in the pool (a PD router: in every "
                                  "ready node's)")
        total.add_metric([], float(s.get("pages_total", 0)))
        yield total
        cap = GaugeMetricFamily("kvfence_kv_capacity_tokens", "Tokens the KV pool holds (a PD router: its decode "
                                "nodes', where requests generate)")
        cap.add_metric([], float(s.get("capacity_tokens", 0)))
        yield cap
        ctx = GaugeMetricFamily("kvfence_context_tokens", "Advertised (usable) context length")
        ctx.add_metric([], float(s.get("usable_context", 0)))
        yield ctx
        pc = GaugeMetricFamily("kvfence_prefill_cap_tokens", "Prefill tokens a step that also decodes may hold now "
                               "(sized from --decode-step-target-ms; 0: no cap, the whole step budget)")
        pc.add_metric([], float(s.get("prefill_cap_while_decoding", 0)))
        yield pc
        viol = CounterMetricFamily("kvfence_isolation_violations", "Isolation checks that failed, by invariant; "
                                   "each one aborted a request and quarantined the page", labels=["invariant"])
        found = dict(s.get("violations", {}))
        for inv in sorted(set(INVARIANTS) | set(found)):
            viol.add_metric([inv], float(found.get(inv, 0)))
        yield viol
        hits = CounterMetricFamily("kvfence_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                   "tenant-scoped prefix cache")
        hits.add_metric([], float(s.get("prefix_cache_hit_tokens", 0)))
        yield hits
        pre = CounterMetricFamily("kvfence_preemptions", "Sequences preempted (pages returned; on return, "
                                  "what the sequence's own prefix cache still holds is attached, the rest recomputed)")
        pre.add_metric([], float(s.get("preemptions", 0)))
        yield pre
        comp = CounterMetricFamily("kvfence_tokens_computed", "Tokens the model computed K/V for: prompts (less "
                                   "prefix-cache hits), generated tokens, and recomputation after preemption")
        comp.add_metric([], float(s.get("tokens_computed", 0)))
        yield comp
        ledger = CounterMetricFamily("kvfence_kv_page_events", "Ledger page events", labels=["event"])
        counters = s.get("ledger_counters", {})
        for ev in ("pages_allocated", "pages_freed", "pages_quarantined"):
            ledger.add_metric([ev], float(counters.get(ev, 0)))
        yield ledger
        yield from _pd_metrics(s.get("pd"))
        fleet = s.get("fleet")
        if fleet:
            nodes = GaugeMetricFamily("kvfence_pd_fleet_nodes", "PD router: nodes by role and state (only ready "
                                      "nodes get requests; refused ones failed the capacity check, I8)",
                                      labels=["role", "state"])
            for role, states in sorted(fleet.items()):
                for st, n in sorted(states.items()):
                    nodes.add_metric([role, st], float(n))
            yield nodes
        changes = s.get("fleet_changes")
        if changes:
            entered = CounterMetricFamily("kvfence_pd_fleet_node_changes", "PD router: times a node entered each "
                                          "state since the router started (down: it stopped answering), by role",
                                          labels=["role", "state"])
            restarts = CounterMetricFamily("kvfence_pd_fleet_node_restarts", "PD router: nodes seen back with a "
                                           "new boot id (a restart), by role", labels=["role"])
            for role, by_state in sorted(changes.items()):
                restarts.add_metric([role], float(by_state["restarts"]))
                for st, n in sorted(by_state.items()):
                    if st != "restarts":
                        entered.add_metric([role, st], float(n))
            yield entered
            yield restarts
        retries = s.get("pd_retries")
        if retries is not None:
            r = CounterMetricFamily("kvfence_pd_request_retries", "PD router: requests sent to another node before "
                                    "anything reached their client, by stage (prefill: before it held the KV; "
                                    "decode: before it admitted the request; handoff: the whole request again, "
                                    "without the node that failed its handoff)", labels=["stage"])
            for stage, n in sorted(retries.items()):
                r.add_metric([stage], float(n))
            yield r
        audit = s.get("audit")
        if audit is not None:
            a = CounterMetricFamily("kvfence_read_audit_violations", "Reads and writes the read audit (a test "
                                    "oracle, --audit-reads) found outside the reader's own pages", labels=["kind"])
            for kind, n in sorted((audit.get("by_kind") or {}).items()):
                a.add_metric([kind], float(n))
            yield a


# the handoff events each role counts (kvfence/pd/prefill.py, decode.py, link.py)
ROLE_EVENTS = {"prefill": ("held", "released", "leases_expired", "fences"),
               "decode": ("pulls_started", "verified", "verify_failed", "pulls_failed", "pulls_given_up", "fences")}


def _pd_metrics(pd: dict | None):
    """A PD node's transfer buffer and handoff counters (absent on single-node servers)."""
    if not pd:
        return
    rows = GaugeMetricFamily("kvfence_pd_transfer_buffer_rows", "KV transfer-buffer rows by state (fenced: a remote "
                             "party may still read or write them, I6)", labels=["state"])
    free, total, fenced = pd.get("buffer_free", 0), pd.get("buffer_rows", 0), pd.get("buffer_fenced", 0)
    rows.add_metric(["free"], float(free))
    rows.add_metric(["fenced"], float(fenced))
    rows.add_metric(["held"], float(max(0, total - free - fenced)))
    yield rows
    events = CounterMetricFamily("kvfence_pd_events", "Handoff events on this node (held, released, leases_expired, "
                                 "pulls_started, verified, verify_failed, pulls_failed, pulls_given_up, "
                                 "stale_notices, late_notices, fences)", labels=["event"])
    # every event of the node's role from the start, at 0: a series that first appears at 1 hides
    # its first increase from Prometheus (increase() needs two samples), and the alert rules'
    # first transfer that fails verification is the one that matters
    counts = {e: 0 for e in ROLE_EVENTS.get(pd.get("role", ""), ())}
    counts.update({k[3:]: v for k, v in pd.items() if k.startswith("pd_")})
    for k, v in sorted(counts.items()):
        events.add_metric([k], float(v))
    yield events
    if "transferred_bytes" in pd:
        moved = CounterMetricFamily("kvfence_pd_transferred_bytes", "KV bytes pulled from prefill nodes")
        moved.add_metric([], float(pd["transferred_bytes"]))
        yield moved
