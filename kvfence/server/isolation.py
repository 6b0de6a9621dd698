"""The isolation statement: what a customer asks a provider in writing, answered from the
live configuration (GET /v1/kvfence/isolation and `kvfence isolation` print the same).

Also the start-up checks that the statement reports. They run in the engine thread before
the server accepts a request; a failed check stops start-up (fail closed).
"""
from __future__ import annotations

import datetime as _dt

from kvfence import __version__, faults, incidents
from kvfence.engine.params import SamplingParams
from kvfence.kv.ledger import PageState

STARTUP_TENANT = "kvfence-startup-check"

_SCRUB_MEANING = {
    "zero": "every freed KV page is overwritten with zeros before it can be granted again",
    "poison": "every freed KV page is overwritten with NaN, so any stray read would be loud",
    "none": "freed KV pages keep their bytes until reused; the ledger's read checks alone stop any "
            "request from reading them",
}


class StartupCheckFailed(RuntimeError):
    pass


def run_startup_checks(engine) -> list[dict]:
    """Run in the engine thread on the freshly built engine; raise if a required check fails."""
    led = engine.ledger
    checks = [_check("capacity", "I8", True,
                     f"advertised context {engine.usable_context} tokens <= KV pool {led.capacity_tokens} tokens; "
                     f"{engine.context.note}")]
    if engine.usable_context > led.capacity_tokens:  # plan_context guarantees this; say so if it ever breaks
        checks[-1].update(status="failed")
    checks.append(_check("read checks before every forward pass", "I2, I3", led.checks_enabled,
                         "every page of every sequence is checked against the ownership ledger and the written "
                         "watermark before each forward pass" if led.checks_enabled else
                         "DISABLED (verify_reads=False): pages are not checked before forward passes",
                         fatal=False))
    checks.append(fault_injection_check())
    checks += _warm_up(engine)
    failed = [c for c in checks if c["status"] == "failed" and c.pop("fatal", True)]
    for c in checks:
        c.pop("fatal", None)
    for c in failed:
        incidents.record("startup_check_failed", invariant=c["invariant"], detail=f"{c['name']}: {c['detail']}")
    if failed:
        raise StartupCheckFailed("; ".join(f"{c['name']}: {c['detail']}" for c in failed))
    return checks


def fault_injection_check() -> dict:
    """Test-only fault points (kvfence/faults.py) must be visible wherever the server reports
    on itself: enabled ones make this check fail (not fatal: tests start such servers on purpose)."""
    on = faults.describe()
    if on:
        faults.announce()  # the ERROR-level banner, once per server start
        faults.record_active()
        return _check("fault injection", "all", False,
                      f"ACTIVE ({', '.join(on)}): this server is deliberately broken for testing and must never "
                      f"serve real traffic ({faults.ENV_VAR})", fatal=False)
    return _check("fault injection", "all", True, f"none active ({faults.ENV_VAR} is not set)", fatal=False)


def _disclosure_terms(tenants) -> dict:
    """The customer's third question: what happens, and when am I told, if isolation fails.
    The commitments are the operator's ([disclosure] in the tenants file); the record is
    this process's incident log."""
    d = getattr(tenants, "disclosure", {}) or {}
    log = incidents.current()
    return {
        "contact": d.get("contact"), "postmortems_published_at": d.get("postmortems"),
        "notification_window_hours": d.get("notification_window_hours"),
        "configured": bool(d),
        "incident_log": ({**log.describe(), "role": log.role, "boot_id": log.boot_id} if log is not None else None),
        "what_is_recorded": ("every isolation event (refused reads, audit findings, failed transfer verification, "
                             "fences ended by time, refused nodes, test faults on at start-up, failed start-up "
                             "checks), within the request that caused it and before its error is returned: the "
                             "requesting tenant, the tenants whose data the refused page or row held, the pages, "
                             "and what the client got; never prompt or completion text. Hash-chained: "
                             "`kvfence incidents --verify` finds a line edited, inserted or removed before the "
                             "last; the chain has no key, so the last line and lines cut off the end are checked "
                             "against a last_hash kept elsewhere (`--expect-last-hash`)"),
    }


def _fault_terms() -> dict:
    on = faults.describe()
    return {"active": bool(on), "faults": on,
            "meaning": ("deliberate defects are switched on for testing; the guarantees above do NOT hold"
                        if on else "no test fault point is enabled")}


def _check(name: str, invariant: str, ok: bool, detail: str, fatal: bool = True) -> dict:
    return {"name": name, "invariant": invariant, "status": "passed" if ok else "failed", "detail": detail,
            "fatal": fatal}


def _warm_up(engine) -> list[dict]:
    """One tiny request end to end: it must finish, trip no check, and give back every page,
    and the pages it held must read back scrubbed as the policy says."""
    led = engine.ledger
    before_viol = dict(led.violations)
    shared = lambda: getattr(led, "num_shared", 0)  # noqa: E731 - pages held by the prefix cache
    free_before, shared_before = led.num_free, shared()
    ids = engine.tokenizer.encode("kvfence start-up check") or [0]
    seq = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                             tenant=STARTUP_TENANT, request_id="kvfence-startup-check")
    used: list[int] = []
    for _ in range(64):
        if not engine.has_unfinished():
            break
        engine.step()
        used = used or list(seq.table.pages)
    returned = (led.num_owned == 0 and led.num_quarantined == 0
                and led.num_free + shared() == free_before + shared_before)
    ok = seq.finish_reason == "length" and len(seq.output_ids) == 2 and dict(led.violations) == before_viol
    detail = (f"{len(ids)} prompt tokens -> {len(seq.output_ids)} tokens (finish_reason={seq.finish_reason}), "
              f"{len(used)} page(s) granted and {'all returned' if returned else 'NOT all returned'}, "
              f"isolation violations {dict(led.violations) or 'none'}")
    out = [_check("warm-up request", "I1, I2, I3", ok and returned, detail)]
    policy = led.scrub.value
    used = [p for p in used if led.state[p] == PageState.FREE]   # not those kept by the prefix cache
    if policy == "none" or not used:
        out.append({"name": "scrub on free", "invariant": "I7", "status": "skipped",
                    "detail": "scrub policy is none" if used else "the warm-up freed no page"})
        return out
    data = engine.pool.read_pages(used).float()
    if policy == "zero":
        clean = bool((data == 0).all())
    else:
        clean = bool(data.isnan().all()) if engine.pool.dtype.is_floating_point else bool((data == -1).all())
    out.append(_check("scrub on free", "I7", clean,
                      f"{len(used)} page(s) the warm-up request held read back "
                      f"{'as ' + policy if clean else 'NOT scrubbed'} after it finished"))
    return out


# what opting in means, said where the opt-in is stated: a hit is visible in cached_tokens
_SCOPE_PROBE = ("every prompt sent in a scope, earlier answers sent back in a conversation included, can be "
                "tested by any tenant of the scope: a guess that matches it reports cached tokens. The model's "
                "own output is never shared")


def _prefix_cache_terms(enabled: bool, tenants) -> dict:
    if not enabled:
        return {"enabled": False,
                "scope": "disabled: no KV page is ever shared between requests; each request computes its own "
                         "prompt into pages only it owns"}
    public, opted = tenants.facts.public_scopes, tenants.facts.opted_in
    return {
        "enabled": True,
        "scope": "per tenant: every cache key is a hash chain seeded with the tenant, so a request can only "
                 "reuse prompt-prefix pages computed for its own tenant; another tenant's identical prompt never "
                 "hits, so another tenant's prompts cannot be probed by timing or cached_tokens",
        "pages": "cached pages are read-only and reference-counted; the ledger checks their scope before every "
                 "forward pass, and an evicted page is scrubbed by the policy above before reuse",
        "eviction": "when the pool is full, a page is evicted from the scope that caches the most unreferenced "
                    "pages, its least recent first; the pool is shared, so a tenant that fills it with its own "
                    "cached pages can count from its own cached_tokens how many pages the others' requests took "
                    "(their volume in tokens, to a page), and by sizing its own cache, whether another scope keeps "
                    "more idle cached pages than it; never their content",
        "cross_tenant_sharing": (f"explicit opt-in only: {opted} tenant(s) share {len(public)} declared public "
                                 f"prefix scope(s); {_SCOPE_PROBE}") if public else "none: no tenant has opted in",
        "visible_as": "usage.prompt_tokens_details.cached_tokens",
    }


def _pd_terms(facts: dict) -> dict:
    """The network part of the statement, for a PD router or node (I10, I11)."""
    security = facts.get("pd_security")
    if security is None and "pd" not in facts and "cluster" not in facts:
        return {}
    security = security or {"tls": False, "client_certificates_required": False, "plaintext_network_allowed": False}
    warnings = []
    if security["plaintext_network_allowed"]:
        warnings.append("WARNING: this PD process was started with --allow-plaintext-network: internal HTTP (the "
                        "cluster credential, prompts as token ids, manifests) may cross the network in the clear")
        if "cluster" not in facts and not security["client_certificates_required"]:   # a node (check_listen)
            warnings.append("WARNING: this node requires no client certificate (no --tls-ca): any host that "
                            "reaches its port can open connections, and hold all of --max-connections")
    return {
        "warnings": warnings,
        "pd_network": {
            "threat_model": "any host that reaches a node's ports is a possible adversary; Mooncake's transfer "
                            "ports listen on all interfaces and authenticate nothing",
            "transfer_plane": {
                "cipher": "AES-256-GCM (cryptography), a key per hold: HKDF-SHA256 of the cluster secret, a "
                          "random salt, the prefill boot id, request id and tenant; nonce = page index; "
                          "associated data = the page header (request, tenant, boot, epoch, index, count, "
                          "tokens), never stored",
                "decode": "each pulled row is copied once into private memory, authenticated and decrypted "
                          "there; only that plaintext reaches pool pages",
                "freed_rows": "zeroed on both nodes",
                "a_network_peer_can": "see row sizes, how many rows are in use and when; read ciphertext or "
                                      "zeros; overwrite rows, which fails the affected request "
                                      "(kv_verification_failed)",
                "a_network_peer_cannot": "read a byte of any tenant's KV, learn which tenant a row belongs to, "
                                         "or make a forged, replayed or foreign row reach attention",
            },
            "control_plane": {
                "credential": "every /internal/* route requires a credential derived from the cluster secret "
                              "(HKDF-SHA256), compared in constant time (401 otherwise); PD processes refuse to "
                              "start without the secret",
                "transport": security,
                "messages": "one strict definition per internal message (kvfence/pd/messages.py); a malformed "
                            "one is a 400 and the node keeps serving",
                "pull_source": "decode pulls only from the transfer session the router read from the prefill "
                               "node itself, never from an address a manifest names",
            },
            "cache_scopes": "on a node, each router process's tenants have their own prefix-cache scopes, so "
                            "a restarted or second router never reaches pages cached for another's tenant "
                            "of the same name; a router's tenants-file reload retires a name's scope on each "
                            "node when its message arrives, or before the first request of the new "
                            "generation there, and a node that retired it refuses a request stamped before "
                            "(scope_retired). The scopes of a router process that sent a node nothing for "
                            "its --router-scope-idle (600 s by default; a restarted router is a new process) "
                            "are retired there, until then unreachable",
        },
    }


def tenant_view(statement: dict, tenant) -> dict:
    """The statement as `tenant`'s key gets it: the same promises and the same counts of
    isolation events, without what tells one tenant about the others or about the host (the
    incident log's path on disk, how many tenants there are, how many opted into sharing and
    the other tenants' prompt caps, the pool's live occupancy, which follows everyone's load);
    its own prompt cap and sharing scope instead. The operator console and `kvfence isolation`
    on the host show it whole."""
    out = {**statement, "audience": "tenant"}
    iso = dict(out["kv_memory_isolation"])
    iso["tenancy"] = {k: v for k, v in iso["tenancy"].items() if k != "tenants_configured"}
    if iso.get("prefix_cache", {}).get("enabled"):
        scope = tenant.public_prefix_scope
        iso["prefix_cache"] = {**iso["prefix_cache"], "cross_tenant_sharing": (
            f"explicit opt-in only: your requests share prompt-prefix pages with the tenants of public prefix "
            f"scope {scope!r}; {_SCOPE_PROBE}" if scope else
            "explicit opt-in only: your tenant has not opted in, so none of its pages is shared")}
    out["kv_memory_isolation"] = iso
    cap = {k: v for k, v in out["capacity"].items() if k != "per_tenant_prompt_caps"}
    cap["pools"] = _pools_for_a_tenant(cap["pools"])
    cap["your_prompt_cap"] = tenant.limits.max_prompt_tokens
    out["capacity"] = cap
    disc = dict(out["incident_disclosure"])
    if disc.get("incident_log"):
        disc["incident_log"] = {k: v for k, v in disc["incident_log"].items() if k != "path"}
    out["incident_disclosure"] = disc
    out["live"] = {k: v for k, v in out["live"].items() if k in ("isolation_violations", "pages_quarantined")}
    return out


def _pools_for_a_tenant(pools: list[dict]) -> list[dict]:
    """Behind a router, where its nodes are, how many there are and which is up now are the
    operator's (a tenant listing the ready pools counted the fleet and, polling, saw a node
    drop out: a security probe). A tenant gets one pool per role: the smallest of the nodes
    that may serve it (those the capacity check passed, up or not), which bounds its requests.
    A single node's one pool is shown as it is."""
    fit = [p for p in pools if p.get("advertised_context_fits", True) and p.get("state") != "refused"] or pools
    out = []
    for role in dict.fromkeys(p.get("role") for p in fit):
        least = min((p for p in fit if p.get("role") == role), key=lambda p: p["capacity_tokens"])
        out.append({k: v for k, v in least.items() if k not in ("node", "state")})
    return out


def isolation_statement(facts: dict, checks: list[dict], tenants, snapshot: dict, served_model_name: str) -> dict:
    """The statement, as JSON. `facts` and `snapshot` come from the engine loop."""
    scrub = facts["scrub"]
    usable, pool_tokens = facts["usable_context"], facts["pool_tokens"]
    prefix = _prefix_cache_terms(facts.get("prefix_cache", False), tenants)
    return {
        "service": "kvfence", "version": __version__,
        "generated_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": {"served_name": served_model_name, "name": facts["model_name"],
                  "fingerprint": facts["fingerprint"], "dtype": facts["dtype"], "device": facts["device"]},
        "kv_memory_isolation": {
            "summary": ("Every KV-cache page has exactly one owner record in an ownership ledger: (tenant, request, "
                        "epoch), or for a read-only prefix-cache page its tenant's cache scope. Before every forward "
                        "pass, every page each request will read is checked against that ledger (owned by this "
                        "request in the current epoch, or a cached page of its own scope) and against a written "
                        "watermark (only slots this request wrote are attended). A failed check aborts that request "
                        "with an error, never a 200, and quarantines the page; other requests continue. "
                        f"Freed pages: {_SCRUB_MEANING[scrub]}."),
            "ownership_ledger": {"enforced": True, "invariants": ["I1 ownership", "I2 read authorization",
                                                                  "I3 written watermark"]},
            "read_checks_before_every_forward_pass": facts["read_checks"],
            "scrub_policy": {"policy": scrub, "meaning": _SCRUB_MEANING[scrub]},
            "quarantine": "a page named by a failed check, or one a writer may still touch, is taken out of "
                          "circulation instead of being reused",
            "prefix_cache": prefix,
            "tenancy": {
                "mode": "single-tenant" if tenants.single_tenant else "multi-tenant",
                "tenants_configured": len(tenants.tenants),
                "identity": ("every request belongs to tenant 'default'; API keys are not checked"
                             if tenants.single_tenant else
                             "the tenant is the one the API key belongs to (keys compared in constant time); "
                             "no request field can choose or change it"),
                "who_sees_tenant_names": (
                    "one tenant only ('default'): /metrics is open" if tenants.single_tenant else
                    "no tenant: the API answers a tenant about its own requests only; /metrics (series per tenant) "
                    "and the operator console need the tenants file's [metrics] or [operator] key, never a "
                    "tenant's"),
            },
        },
        "capacity": {
            "advertised_context_tokens": usable,
            "model_max_context_tokens": facts["model_max_context"],
            "configured_max_model_len": facts["configured_max_model_len"],
            "clamped_to_pool": facts["context_clamped"],
            # a PD router's are its nodes', from their last report (pd/router.py, _merge_snapshots)
            "pools": snapshot.get("pools") or [
                {"node": "local", "pages": facts["pool_pages"], "page_size_tokens": facts["page_size"],
                 "capacity_tokens": pool_tokens, "bytes": facts["pool_bytes"],
                 "advertised_context_fits": usable <= pool_tokens}],
            "note": facts["context_note"],
            "request_that_does_not_fit": (
                f"a request whose prompt plus max_tokens exceeds {usable} tokens is rejected with HTTP 400 "
                "(code context_length_exceeded, naming the limit and the request's token count) before any KV "
                "page is allocated or any computation runs; a rejected request never runs"),
            "per_tenant_prompt_caps": None if tenants.single_tenant else tenants.facts.prompt_caps,
        },
        "data_handling": {
            "prompt_text_logged": False, "prompt_text_stored": False,
            "completion_text_logged": False, "completion_text_stored": False, "api_keys_logged": False,
            "what_is_logged": "request id, tenant, token counts, finish reason, status and timings",
            "retention": "prompt and completion text live only in memory for the life of the request; the engine "
                         "is given token ids, never the prompt text",
        },
        **_pd_terms(facts),
        "incident_disclosure": _disclosure_terms(tenants),
        "fault_injection": _fault_terms(),
        "startup_checks": checks,
        "live": {
            "pages_free": snapshot.get("pages_free"), "pages_used": snapshot.get("pages_owned"),
            "pages_prefix_cache": snapshot.get("pages_shared", 0),
            "pages_quarantined": snapshot.get("pages_quarantined"),
            "isolation_violations": dict(snapshot.get("violations", {})),
        },
    }
