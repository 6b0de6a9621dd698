"""The PD router: the OpenAI API in front of one prefill and one decode node.

It plugs into the same HTTP app as single-node `serve` (server/app.py) by offering the
engine loop's interface (state, facts, snapshot, tokenizer, submit, abort), so auth,
tenant limits, streaming, errors and metrics are the same code. What differs is submit:

  router admission (I4, against the cluster's checked capacity, I8; app.py does it)
  -> prefill: admit (node I4), compute, hold; returns the manifest       [skipped for a 1-token prompt]
  -> decode: admit (node I4), check the manifest, reserve, pull, verify (I5), generate
  -> on kv_verified: ACK to prefill (RELEASE); submit returns (the client's answer begins)
  -> on any failure or client disconnect: abort on both sides; prefill frees the rows at
     once only if decode said no pull can be running, else it fences them (I6)
  -> a node that fails before anything reached the client: prefill or decode once more on
     another node of its role, or, once prefill held the KV, the whole request once more
     without the failed node (may_retry_prefill, may_retry_decode, may_redo)

A node that answers nothing for `stall_s` (nodes send a heartbeat every second) fails the
request with a clear error, so a hung node never hangs a client. A monitor polls every
node each second: a node that stops answering makes the router not ready (503), and a
node that comes back with a new boot id is checked again (I8) before it serves.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import ssl
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request

from kvfence import faults, incidents
from kvfence.engine.admission import ContextLengthExceeded, Overloaded, completion_tokens
from kvfence.engine.params import SamplingParams
from kvfence.pd.addresses import NodeAddress, Resolver, expand, system_resolver
from kvfence.pd.capacity import ClusterCheck, plan_fleet
from kvfence.pd.fleet import Fleet, Node
from kvfence.pd.messages import (
    MAX_TENANTS,
    AbortBody,
    AdmittedEvent,
    DecodeBody,
    FailedEvent,
    ForgetTenantsBody,
    ForgetTenantsReply,
    Handoff,
    Manifest,
    MessageError,
    NodeInfo,
    PrefillBody,
    ProgressEvent,
    RejectedEvent,
    ReleaseBody,
    ScopeStamp,
    StopPullBody,
    StopPullReply,
    WaitEvent,
    WireModel,
    WireParams,
    parse_event,
)
from kvfence.pd.seal import Keyring, SecretSet, key_id
from kvfence.pd.settings import ROLES
from kvfence.pd.tls import (
    FOLLOW_PROXY_ENV,
    PlaintextNetworkError,
    TlsSettings,
    check_node_url,
    client_context,
    uvicorn_options,
)
from kvfence.pd.wire import ClusterAuth
from kvfence.server.backend import Admitted, EngineFailed, Logprob, NotServedHere, RequestHandle, Update, shut_out
from kvfence.server.http_limits import HttpLimits, uvicorn_server
from kvfence.server.shutdown import BACKSTOP_S, DEFAULT_SHUTDOWN_TIMEOUT_S, GracefulStop

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("kvfence.pd.router")


def load_router_tokenizer(model: str | None):
    """The tokenizer alone (no weights): from the GGUF's metadata or the folder's tokenizer.json."""
    from kvfence.model.loader import default_model_path

    p = Path(model) if model else default_model_path()
    if p.is_dir():
        from kvfence.model.tokenizer import tokenizer_from_hf_folder
        return tokenizer_from_hf_folder(p)
    from kvfence.model.gguf_loader import read_metadata
    from kvfence.model.tokenizer import tokenizer_from_gguf_metadata
    return tokenizer_from_gguf_metadata(read_metadata(p))


class NodeError(RuntimeError):
    """A node refused or failed the request; `rejection` is the node's own refusal, if any.
    `retryable`: the node took nothing of it (never reached, or refused for load), so
    another node of the role may be tried."""

    def __init__(self, message: str, code: str, rejection: RejectedEvent | None = None, retryable: bool = False,
                 maybe_taken: bool = False, culprit: str | None = None):
        super().__init__(message)
        self.code = code
        self.rejection = rejection
        self.retryable = retryable
        # the connection broke after the request went out: the node may have taken it (a decode
        # node may be pulling its rows), so nothing of it is known to have stopped
        self.maybe_taken = maybe_taken
        # what failed the handoff, not the request: "prefill" or "decode" (that role's node died
        # or went silent), "transfer" (a read of the rows failed); the whole request may be done
        # again without it (may_redo, nodes_to_avoid)
        self.culprit = culprit


MAX_NODE_CONNECTIONS = 1000   # the router's to all its nodes together (httpx's pool)

RETRY_STAGES = ("prefill", "decode", "handoff")   # kvfence_pd_request_retries_total{stage}
# failures after which a request that has sent nothing to its client is tried once more
RETRY_CODES = frozenset({"node_unavailable", "node_failed", "server_overloaded", "not_ready", "draining",
                         "engine_unavailable"})
# a node that refuses for these took nothing: another node of its role may take the request.
# engine_unavailable: its engine stopped, or a scope retirement the request queued behind
# failed; either way the node refused it before admitting it (EngineLoop.submit)
REFUSED_FOR_LOAD_OR_STATE = frozenset({"server_overloaded", "not_ready", "draining", "engine_unavailable"})


def _described(e: BaseException) -> str:
    """An error for a message: its kind, and its text where it has one (httpx's reset has none)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def may_retry_prefill(code: str, holds_kv: bool, tried: int) -> bool:
    """Prefill once more on another node? Only the first failure, and only before the node
    held the KV (what it had is its own: it aborts the request when the stream drops)."""
    return not holds_kv and not tried and code in RETRY_CODES


def may_retry_decode(code: str, retryable: bool, admitted: bool, tried: int) -> bool:
    """Decode once more on another node? Only the first failure, and only if the node never
    took the request (not reached, or refused for load or state before admitting it):
    prefill still holds the rows under the same lease, and nothing reached the client."""
    return not admitted and not tried and retryable and code in RETRY_CODES


def may_redo(culprit: str | None, holds_kv: bool, answered: bool, redone: bool) -> bool:
    """Do the whole request again (prefill and decode, under a new node request id) once its
    handoff failed? Only once, only before anything reached the client, only after prefill held
    the KV (before that, prefill's own retry applies), and only when a node failed rather than
    the request (a stream that broke or went silent, a read of the rows that failed): not for a
    refusal, for load (a lease that ran out, a pull slower than decode's give-up: a redo would
    double the work where capacity is short), or for KV that failed verification (I10:
    tampering is reported, never routed around). The nodes it skips: nodes_to_avoid."""
    return culprit is not None and holds_kv and not answered and not redone


def nodes_to_avoid(culprit: str, prefill: str | None, decode: str | None,
                   other: Callable[[str, frozenset[str]], bool]) -> dict[str, frozenset[str]] | None:
    """role -> the node a redo skips, or None: no redo helps. The culprit's node, where another
    of its role is ready; a failed read ("transfer") may be either end's fault (prefill gone,
    or decode's own transfer engine), so each end that has another, at least one. The role not
    skipped needs a ready node too. `other(role, exclude)`: a ready node of role outside exclude.
    Within the redo the skipped node counts as tried: no further retry on that role."""
    ends = {"prefill": prefill, "decode": decode}
    roles = ("prefill", "decode") if culprit == "transfer" else (culprit,)
    avoid = {r: frozenset({url}) for r in roles if (url := ends[r]) is not None and other(r, frozenset({url}))}
    if not avoid or (culprit != "transfer" and culprit not in avoid):
        return None
    if any(r not in avoid and not other(r, frozenset()) for r in ends):
        return None
    return avoid


def ready_elsewhere(fleet: Fleet, scope: str, ids: list[int]) -> Callable[[str, frozenset[str]], bool]:
    """nodes_to_avoid's `other` for a request of `scope` and prompt `ids`: whether the fleet
    would pick a node of role outside exclude (the router's and the simulation's picks)."""
    def other(role: str, exclude: frozenset[str]) -> bool:
        node = (fleet.pick_prefill(scope, ids, fleet.reference.page_size, exclude) if role == "prefill"
                else fleet.pick_decode(exclude))
        return node is not None
    return other


# decode's code for a read of the rows that failed (the engine's error, not a timeout)
TRANSFER_FAILURES = frozenset({"kv_transfer_failed"})


@dataclass
class _Flight:
    """One attempt of a request through the handoff, for its cleanup. `request_id` is the
    nodes' name for the attempt: a redo is a new request to them (decode refuses an id it
    gave up on), while the client's request keeps the router's id."""
    request_id: str
    client_rid: str
    avoid: dict[str, frozenset[str]] = field(default_factory=dict)   # role -> nodes this attempt skips
    settled: bool = False
    manifest: Manifest | None = None
    released: bool = False
    reader_stopped: bool = False      # decode is known not to be pulling (refused, or said so)
    decode_contacted: bool = False
    decode_admitted: bool = False     # a decode node took it: never retried elsewhere from here
    cached: int = 0
    completion: int = 0               # tokens decode reported so far
    prefill: Node | None = None       # the nodes this request is on
    decode: Node | None = None
    started_at: float | None = None   # its first step on prefill (this process's perf_counter)

    @property
    def redone(self) -> bool:
        """This attempt is the redo (its own node request id): there is no other."""
        return self.request_id != self.client_rid


class RouterBackend:
    """The PD fleet as an EngineBackend (server/backend.py) for server/app.py."""

    builds_grammars = False
    orders_choices = True

    def __init__(self, prefill_urls: str | list[str], decode_urls: str | list[str], secret: bytes | Keyring,
                 tls: TlsSettings | None = None, model: str | None = None,
                 max_model_len: int | None = None, clamp_context: bool = False, wait_s: float = 300.0,
                 stall_s: float = 10.0, poll_s: float = 1.0, join_grace_s: float = 5.0,
                 prefill_routing: str = "affinity", resolve: Resolver = system_resolver, resolve_s: float = 5.0):
        self.urls = {"prefill": _url_list(prefill_urls), "decode": _url_list(decode_urls)}
        self.resolve, self.resolve_s = resolve, resolve_s   # names behind the URLs: found again this often
        # configured plain-HTTP URL -> the addresses off loopback its name now resolves to (_expand)
        self.refused_plain: dict[str, list[str]] = {}
        # the secret it sends with: a Keyring follows a reload of its file (SIGHUP)
        self.keyring = secret if isinstance(secret, Keyring) else Keyring(SecretSet(secret))
        self._auth = ClusterAuth(self.keyring)
        self.tls = tls or TlsSettings()
        # https node URLs are verified against --tls-ca (the system's CAs without it)
        self._verify: ssl.SSLContext | bool = (client_context(self.tls) if any(
            u.startswith("https://") for us in self.urls.values() for u in us) else True)
        self.model = model
        self.max_model_len = max_model_len
        self.clamp = clamp_context
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.poll_s = poll_s
        self.join_grace_s = join_grace_s
        self.prefill_routing = prefill_routing
        self.tokenizer = None
        self.facts: dict | None = None
        self.snapshot: dict = {}
        self.startup_checks: list[dict] = []
        self.check: ClusterCheck | None = None
        self.fleet: Fleet | None = None
        self._start_error: str | None = None   # why start-up gave up (then there is no fleet)
        self.iterations = 0
        self._ready = False
        self._started = False
        self._stopped = False
        self._tasks: dict[str, asyncio.Task] = {}
        # rid -> [tenant, generating]: whose requests wait (prefill, transfer rows, decode's pages)
        # and whose generate, for the operator (kvfence_tenant_sequences; each node's own counts
        # miss a request waiting for transfer rows or for decode's pages)
        self._tenant_of: dict[str, list] = {}
        # rid -> set once its prefill node holds its prompt's KV (or it ended): a choice submitted
        # `after` it prefills then, attaching those pages from prefill's cache (see submit)
        self._prompt_held: dict[str, asyncio.Event] = {}
        self._cancelled: set[str] = set()   # aborts already under way (see abort)
        # end_all: the abort code a submission gets from then on, and each ended request's (code, why)
        self.closing: str | None = None
        # requests sent to another node before anything reached their client, by stage: prefill
        # (before holding the KV), decode (before admitting it), handoff (the whole request redone)
        self.retries: Counter[str] = Counter()
        self._ending: dict[str, tuple[str, str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None   # the server's, where requests run
        self._background: set[asyncio.Task] = set()
        self._client: httpx.AsyncClient | None = None
        self.ready = threading.Event()
        self.router_id = uuid.uuid4().hex   # this process, in the scope stamps (pd/scope_epochs.py)

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def _serving(self) -> bool:
        """Ready as of the monitor's last round, and still so now: a node marked down or sent
        back to checking (by a poll, or a request it refused) counts at once, not only once the
        round's other polls have answered (up to their timeout later)."""
        return self._ready and self.fleet is not None and self.fleet.ready

    @property
    def state(self) -> str:
        if self._stopped:
            return "stopped"
        if self._serving:
            return "ready"
        return "loading" if self.fleet is None and self._start_error is None else "not_ready"

    @property
    def error(self) -> str | None:
        """Why the router is not serving, read from the fleet now: a node marked down between
        the monitor's rounds changes readiness at once (`_serving`), so its reason must too."""
        if self._start_error is not None:
            return self._start_error
        fleet = self.fleet
        if fleet is None or self._stopped or self._serving:
            return None
        missing = [r for r in ROLES if not fleet.serving(r)]
        if not missing and not fleet.sealable(fleet.serving("prefill")):
            accepted = sorted({k for d in fleet.serving("decode") for k in (d.info.secret_key_ids if d.info else [])})
            return ("no prefill node seals with a cluster secret a ready decode node accepts (" + ", ".join(
                f"{n.url} seals with key id {n.seals_with}" for n in fleet.serving("prefill")) +
                f"; the decode nodes accept {', '.join(accepted) or 'none listed'}): give the decode nodes that "
                "secret with --accept-cluster-secret-file (docs/pd.md, rotating)")
        if not missing:
            return "every role has a ready node again; waiting for the fleet monitor's next round to confirm it"
        return "; ".join(f"no {r} node is ready (" + ", ".join(
            [f"{n.url}: {n.state}{' - ' + n.reason if n.reason else ''}" for n in fleet.nodes if n.role == r] +
            [f"{u} resolves to {', '.join(a)}, off loopback, where plain HTTP is refused"
             for u, a in self.refused_plain.items() if u in self.urls[r]]) + ")"
            for r in missing)

    def _fetch_info(self, c: httpx.Client, a: NodeAddress) -> tuple[NodeInfo | None, str | None]:
        try:
            return _info_of(c.get(a.url + "/internal/info", **a.http_options()))
        except httpx.HTTPError as e:
            return None, f"does not answer ({type(e).__name__})"

    def _expand(self, url: str) -> list[NodeAddress] | None:
        """The addresses behind `url` now (None: its name does not resolve), without those a
        plain-HTTP URL may not reach: the start checked the name (check_node_url), and a name
        can come to mean another host, where the credential would cross the network in the clear."""
        found = expand(url, self.resolve)
        if found is None:
            return None
        kept, refused = [], []
        for a in found:
            try:
                check_node_url(a.url, self.tls)
            except PlaintextNetworkError:
                refused.append(a.url)
                continue
            kept.append(a)
        if refused and self.refused_plain.get(url) != refused:   # said once, not every resolve_s
            log.error("node URL %s now resolves to %s, off loopback: not reached over plain HTTP (use https://)",
                      url, ", ".join(refused))
        if refused:
            self.refused_plain[url] = refused
        else:
            self.refused_plain.pop(url, None)
        return kept

    def _addresses(self, why: dict[str, str]) -> dict[str, list[NodeAddress]]:
        """role -> every address behind the configured URLs now (names that do not resolve
        are noted in `why`)."""
        out: dict[str, list[NodeAddress]] = {}
        for role in ROLES:
            seen: dict[str, NodeAddress] = {}
            for url in self.urls[role]:
                found = self._expand(url)
                if found is None:
                    why[url] = "its host name does not resolve"
                elif not found and url in self.refused_plain:   # _expand left out every address
                    why[url] = (f"its host name resolves to {', '.join(self.refused_plain[url])}, off loopback, "
                                "where plain HTTP is refused (use https://)")
                for a in found or ():
                    seen.setdefault(a.url, a)
            out[role] = list(seen.values())
        return out

    def start(self) -> RouterBackend:
        """Synchronous start-up: wait for at least one node of each role (then join_grace_s
        for the rest), fix the advertised context and check every node that answered (I8).
        Returns with `error` set if the fleet may not serve."""
        if self._started:
            return self
        self._started = True
        self.tokenizer = load_router_tokenizer(self.model)
        deadline = time.monotonic() + self.wait_s
        found: dict[str, tuple[str, NodeInfo]] = {}
        why: dict[str, str] = {}
        grace_end: float | None = None
        with httpx.Client(timeout=5.0, auth=self._auth, verify=self._verify, trust_env=FOLLOW_PROXY_ENV) as c:
            while True:
                addrs = self._addresses(why)
                every = [(role, a.url) for role in ROLES for a in addrs[role]]
                every += [(role, u) for role in ROLES for u in self.urls[role] if u in why and not any(
                    a.configured == u for a in addrs[role])]   # a name that does not resolve is not found yet
                for role in ROLES:
                    for a in addrs[role]:
                        if a.url in found:
                            continue
                        info, err = self._fetch_info(c, a)
                        if info is None:
                            if err != why.get(a.url) and err is not None and err.startswith("refuses"):
                                log.error("%s node at %s %s; waiting up to --node-wait for it", role, a.url, err)
                            why[a.url] = err or "no answer"
                            continue
                        found[a.url] = (role, info)
                        log.info("%s node at %s is up (boot %s)", role, a.url, info.pd.boot_id)
                roles_up = {r for r, _ in found.values()}
                if all(u in found for _, u in every):
                    break
                if roles_up >= set(ROLES):
                    grace_end = grace_end or time.monotonic() + self.join_grace_s
                    if time.monotonic() > grace_end:
                        break
                if time.monotonic() > deadline:
                    missing = [f"{r} node at {u} ({why.get(u, 'no answer')})" for r, u in every if u not in found]
                    if roles_up >= set(ROLES):
                        break
                    self._start_error = f"no usable answer within {self.wait_s:g} s from: " + "; ".join(missing)
                    return self
                time.sleep(0.5)
        chk = plan_fleet(self.max_model_len, found, self.clamp)
        vocab = {f.vocab_size for _, f in found.values()}
        if self.tokenizer is not None and len(vocab) == 1 and self.tokenizer.hf.get_vocab_size() > next(iter(vocab)):
            chk.ok = False
            chk.problems.append("the router's tokenizer has more tokens than the nodes' model")
        self.check = chk
        self.startup_checks = [{"name": "cluster capacity", "invariant": "I8",
                                "status": "passed" if chk.ok else "failed", "detail": chk.note}]
        if not chk.ok:
            self._start_error = f"cluster capacity check failed: {chk.note}"
            log.error("%s", self._start_error)
            incidents.record("startup_check_failed", invariant="I8", detail=self._start_error)
            return self
        for url, reasons in chk.refused.items():
            incidents.record("node_refused", detail=f"{chk.roles.get(url)} node {url} at start: {'; '.join(reasons)}")
        (log.warning if chk.clamped or chk.refused else log.info)("cluster capacity check (I8): %s", chk.note)
        assert chk.reference is not None   # ok: some node passed
        self.fleet = Fleet(addrs, chk.usable_context, chk.reference, self.prefill_routing)
        for node in self.fleet.nodes:
            if node.url in found:
                self.fleet.observe(node, found[node.url][1])
            else:
                self.fleet.observe(node, None, why.get(node.url))
        decode = next(f for u, (r, f) in sorted(found.items()) if r == "decode" and u not in chk.refused)
        base = decode.facts()
        for own in ("compute", "matmul", "kernels"):   # how one decode node runs; no fact of the router's
            base.pop(own, None)
        base.update(usable_context=chk.usable_context, context_clamped=chk.clamped, context_note=chk.note,
                    pool_tokens=min(f.pool_tokens for u, (_, f) in found.items() if u not in chk.refused),
                    configured_max_model_len=self.max_model_len, cluster=chk.to_json(),
                    pd_security=self.tls.describe(),
                    # the prompts' cache lives on the prefill nodes (decode's is always off): the
                    # statement through the router said "disabled" with it on (a fairness probe)
                    prefix_cache=any(f.prefix_cache for u, (r, f) in found.items()
                                     if r == "prefill" and u not in chk.refused))
        self.facts = base
        self._refresh()
        # the monitor has its own thread and event loop; it only swaps attributes
        threading.Thread(target=lambda: asyncio.run(self.run_monitor()), name="kvfence-router-monitor",
                         daemon=True).start()
        return self

    def _refresh(self) -> None:
        """Readiness and the merged snapshot, from the fleet's current state."""
        assert self.fleet is not None
        fleet = self.fleet
        self._ready = fleet.ready and not self._stopped
        snapshot = _merge_snapshots(fleet)
        snapshot["sequences_by_tenant"] = self.requests_by_tenant()
        snapshot["pd_retries"] = {stage: self.retries[stage] for stage in RETRY_STAGES}
        self.snapshot = snapshot   # swapped whole: a scrape reads one or the other
        ready = [n.info.tenant_waiting_places for n in fleet.nodes if n.state == "ready" and n.info is not None]
        places = _smallest(ready) if ready else None
        if ready and self.facts is not None and places != self.facts.get("tenant_waiting_places"):
            # a node that joined with a smaller --max-waiting lowers the bound, one that left raises it
            self.facts = {**self.facts, "tenant_waiting_places": places}

    def requests_by_tenant(self) -> dict[str, dict[str, int]]:
        """tenant -> its requests in flight here: running (its KV reached decode, or decode's first
        token came) and waiting (in prefill, for transfer rows, or for decode's pages). Read from
        the monitor's thread."""
        out: dict[str, dict[str, int]] = {}
        for tenant, generating in list(self._tenant_of.values()):
            out.setdefault(tenant, {"running": 0, "waiting": 0})["running" if generating else "waiting"] += 1
        return out

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._serving

    def stop(self, timeout: float = 30.0) -> None:
        self._stopped = True
        self._ready = False

    # -- the monitor (I8 on every answer) ---------------------------------------------------------
    async def run_monitor(self) -> None:
        assert self.fleet is not None
        fleet = self.fleet
        loop = asyncio.get_running_loop()
        resolved_at = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0, auth=self._auth, verify=self._verify,
                                     trust_env=FOLLOW_PROXY_ENV) as c:
            async def poll(node: Node) -> None:
                try:
                    info, why = _info_of(await c.get(node.url + "/internal/info", **_options(node)))
                except httpx.HTTPError as e:
                    info, why = None, f"does not answer ({type(e).__name__})"
                fleet.observe(node, info, why)
            while not self._stopped:
                await asyncio.sleep(self.poll_s)
                try:
                    if time.monotonic() - resolved_at >= self.resolve_s:
                        resolved_at = time.monotonic()
                        for role in ROLES:
                            for url in self.urls[role]:
                                found = await loop.run_in_executor(None, self._expand, url)
                                if found is not None:   # a name that fails to resolve keeps its nodes (a DNS blip)
                                    fleet.sync(role, url, found)
                    await asyncio.gather(*(poll(n) for n in fleet.nodes))
                    was = self._ready
                    self._refresh()
                except Exception:  # noqa: BLE001 - the monitor is the router's only view of its nodes: it must go on
                    log.exception("the fleet monitor failed this round; it tries again in %.1f s", self.poll_s)
                    continue
                if was and not self._ready:
                    log.error("fleet not ready: %s", self.error)
                elif self._ready and not was:
                    log.info("fleet ready again")
                self.iterations += 1

    # -- requests -----------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.stall_s, connect=5.0), verify=self._verify,
                                             auth=self._auth,
                                             limits=httpx.Limits(max_connections=MAX_NODE_CONNECTIONS,
                                                                 max_keepalive_connections=100),
                                             trust_env=FOLLOW_PROXY_ENV)
        return self._client

    async def submit(self, prompt_ids: list[int], params: SamplingParams, tenant: str,
                     request_id: str | None = None, public_prefix_scope: str | None = None,
                     scope_epoch: int = 0, *, grammar: LLMatcher | None = None,
                     after: str | None = None) -> RequestHandle:
        """`grammar` is not used (builds_grammars): the decode node builds its own matcher.
        A choice submitted `after` its lead (orders_choices: the server submits a request's
        choices at once) starts its prefill once the lead's prefill node holds the prompt's KV,
        so it attaches those pages there; it returns, as every submit, once decode has verified
        its KV. All of a request's choices reach decode close together, so its queue reserves
        them together: the server's two rounds (the leads' submits, then the others') put a
        request's other choices behind every request that arrived meanwhile, and under load a
        choice's lease ran out while its lead generated (its whole answer a 503)."""
        if not self._serving or self.facts is None:
            raise EngineFailed(self.error or f"the cluster is {self.state}")
        if params.prompt_logprobs is not None or params.max_tokens == 0:
            # prefill samples nothing and decode never computes the prompt: neither could score it
            raise NotServedHere("echo with logprobs, and max_tokens 0, are not supported behind the PD router; "
                                "send them to a single-node server")
        max_tokens = completion_tokens(params.max_tokens, len(prompt_ids), self.facts["usable_context"])
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        # the loop first: end_all sets closing, then reads it (a first request racing the deadline)
        loop = self._loop = asyncio.get_running_loop()
        if self.closing is not None:
            raise shut_out(self.closing)
        rid = request_id or f"pd-{time.time_ns()}"
        admitted: asyncio.Future = loop.create_future()
        handle = RequestHandle(rid, asyncio.Queue())
        stamp = ScopeStamp(router=self.router_id, epoch=scope_epoch)
        lead = self._prompt_held.get(after) if after is not None else None   # None: gone, or never
        held = self._prompt_held[rid] = asyncio.Event()
        task = asyncio.create_task(self._run(rid, list(prompt_ids), params, tenant, public_prefix_scope, stamp,
                                             after or rid, lead, held, handle, admitted))
        self._tasks[rid] = task
        self._tenant_of[rid] = [tenant, False]
        task.add_done_callback(lambda _t: self._tasks.pop(rid, None))
        task.add_done_callback(lambda _t: self._tenant_of.pop(rid, None))
        task.add_done_callback(lambda _t: self._prompt_held.pop(rid, asyncio.Event()).set())   # its choices go on

        def never_ran(_t) -> None:   # cancelled before its first step (end_all): _run never set it
            code, why = self._ending.pop(rid, (self.closing or "client", "the router stopped it before it started"))
            if not admitted.done():
                admitted.set_exception(EngineFailed(why, code=code))
        task.add_done_callback(never_ran)
        try:
            await admitted
        except BaseException:
            # through abort: a later abort of the same id (the server's, for a choice whose submit
            # it gave up on) must not cancel it again mid-cleanup (the prefill node then held
            # KV for a client that had hung up)
            self.abort(rid, "the submit was abandoned")
            raise
        handle.admitted = Admitted(rid, len(prompt_ids), max_tokens)
        return handle

    def abort(self, request_id: str, reason: str = "client disconnected") -> None:
        """Idempotent: a second cancel would interrupt the first one's cleanup (closing the
        node streams, which is what aborts the request on the nodes)."""
        task = self._tasks.get(request_id)
        if task is not None and not task.done() and request_id not in self._cancelled:
            self._cancelled.add(request_id)
            task.add_done_callback(lambda _t: self._cancelled.discard(request_id))
            task.cancel()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def end_all(self, code: str, reason: str) -> int:
        """Take no more requests and end every one in flight with abort code `code` (thread-safe;
        their node streams close, which aborts them on the nodes, as a client's abort does)."""
        self.closing = code
        n = len(self._tasks)
        loop = self._loop
        if loop is not None and not loop.is_closed():   # even at 0: one may be between submit's check and its task
            try:
                loop.call_soon_threadsafe(self._end_all_now, code, reason)
            except RuntimeError:   # closed in the meantime: the server has stopped, nothing runs
                pass
        return n

    def _end_all_now(self, code: str, reason: str) -> None:
        for rid in list(self._tasks):
            self._ending[rid] = (code, reason)
            self.abort(rid, reason)

    def _later(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _post(self, node: Node, path: str, body: WireModel) -> None:
        try:
            await self._http().post(node.url + path, **_options(node, **_json(body)))
        except httpx.HTTPError as e:
            log.warning("%s %s %s failed: %s", node.role, node.url, path, e)

    async def _run(self, rid: str, ids: list[int], params: SamplingParams, tenant: str, scope: str | None,
                   stamp: ScopeStamp, choice_of: str, lead: asyncio.Event | None, held: asyncio.Event,
                   handle: RequestHandle, admitted: asyncio.Future) -> None:
        flight = _Flight(rid, rid)

        def last_update(message: str, code: str, completion: int) -> None:
            handle.updates.put_nowait(Update((), "", True, "aborted", message, len(ids), completion, flight.cached,
                                             abort_code=code))

        def fail(message: str, code: str, rejection: RejectedEvent | None = None) -> None:
            if not admitted.done():
                admitted.set_exception(_as_submit_error(message, code, rejection))
                return
            # the tokens decode streamed before it failed reached the client: they count, as a
            # single node counts an aborted request's tokens (its usage, the tenant's token budget)
            last_update(message, code, flight.completion)

        try:
            # inside the try: whatever fails here must end the request, never leave submit() waiting
            wire = WireParams.of(params)
            if lead is not None:
                await lead.wait()
            while True:
                try:
                    await self._attempt(flight, ids, wire, tenant, scope, stamp, choice_of, held, handle, admitted)
                    break
                except NodeError as e:
                    avoid = self._redo_avoiding(e, flight, admitted, scope or tenant, ids)
                    if avoid is None:
                        raise
                    log.warning("request %s: its handoff failed before anything reached the client (%s: %s); "
                                "doing it again without %s", rid, e.code, e,
                                ", ".join(sorted(u for urls in avoid.values() for u in urls)))
                    self.retries["handoff"] += 1
                    self._settle(flight)
                    flight = _Flight(f"{rid}.redo", rid, avoid=avoid, cached=flight.cached)
        except asyncio.CancelledError:
            # abort(): the server side still waits on this handle for the request's last update
            # (without it a hung-up non-streaming request never ends: its tenant slot and its
            # handler stay taken). Code "client", as a single node's engine reports an abort;
            # end_all's own code for a request a stopping router ended
            code, why = self._ending.pop(rid, ("client", "client disconnected"))
            if admitted.done():
                last_update(why, code, flight.completion)
            elif code != "client":   # still in prefill: submit() waits on it
                admitted.set_exception(EngineFailed(why, code=code))
            raise
        except NodeError as e:
            fail(str(e), e.code, e.rejection)
        except Exception as e:  # noqa: BLE001 - whatever a node did, this request fails with a code
            fail(f"a PD node failed mid-request: {_described(e)}", "node_failed")
        finally:
            self._settle(flight)

    async def _attempt(self, flight: _Flight, ids: list[int], wire: WireParams, tenant: str, scope: str | None,
                       stamp: ScopeStamp, choice_of: str, held: asyncio.Event, handle: RequestHandle,
                       admitted: asyncio.Future) -> None:
        """Prefill, then decode, under the attempt's node request id."""
        if len(ids) >= 2:
            body = PrefillBody(request_id=flight.request_id, tenant=tenant, prompt_ids=ids, params=wire,
                               public_prefix_scope=scope, scope=stamp)
            await self._prefill_on_some_node(body, flight, scope or tenant)
        held.set()   # the prompt's pages are in prefill's cache: the request's other choices go
        if len(ids) >= 2 and faults.active("delay_handoff"):
            await asyncio.sleep(faults.arg_float("delay_handoff", 1.0))
        body = DecodeBody(request_id=flight.request_id, tenant=tenant, prompt_ids=ids, params=wire,
                          public_prefix_scope=scope, scope=stamp, handoff=self._handoff(flight, choice_of))
        await self._decode_on_some_node(body, flight, handle, admitted, len(ids))

    def _redo_avoiding(self, e: NodeError, flight: _Flight, admitted: asyncio.Future, scope: str,
                       ids: list[int]) -> dict[str, frozenset[str]] | None:
        """The nodes a redo of the request skips, or None: no redo (may_redo, nodes_to_avoid)."""
        if not may_redo(e.culprit, flight.manifest is not None, admitted.done(), flight.redone):
            return None
        assert self.fleet is not None and e.culprit is not None
        return nodes_to_avoid(e.culprit, flight.prefill.url if flight.prefill else None,
                              flight.decode.url if flight.decode else None, ready_elsewhere(self.fleet, scope, ids))

    def _settle(self, flight: _Flight) -> None:
        """Once per attempt: prefill lets go of rows decode never verified (see _settle_prefill)."""
        if flight.manifest is not None and not flight.released and not flight.settled:
            flight.settled = True
            self._later(self._settle_prefill(flight.request_id, flight))

    async def _prefill_on_some_node(self, body: PrefillBody, flight: _Flight, scope: str) -> None:
        """Prefill on the node the fleet picks; once more on another if that node could not
        take it or died before holding the KV (nothing has reached the client yet, and what
        the first node held is its own: it aborts the request when the stream drops)."""
        assert self.fleet is not None
        tried: set[str] = set(flight.avoid.get("prefill", ()))   # a redo skips the node that failed it
        while True:
            node = self.fleet.pick_prefill(scope, body.prompt_ids, self.fleet.reference.page_size, frozenset(tried))
            if node is None:
                raise NodeError("no prefill node is ready" + (" (tried " + ", ".join(sorted(tried)) + ")"
                                                                if tried else ""), "node_unavailable")
            flight.prefill = node
            try:
                with _routed(node):
                    await self._prefill(body, flight, node)
                return
            except (NodeError, httpx.HTTPError) as e:
                code = e.code if isinstance(e, NodeError) else "node_failed"
                retry = may_retry_prefill(code, flight.manifest is not None, len(tried))
                if not retry or self.fleet.pick_prefill(scope, body.prompt_ids, self.fleet.reference.page_size,
                                                        frozenset({node.url})) is None:
                    raise
                log.warning("request %s: prefill on %s failed (%s: %s); trying another prefill node", body.request_id,
                            node.url, code, e)
                self.retries["prefill"] += 1
                tried.add(node.url)

    def _handoff(self, flight: _Flight, choice_of: str) -> Handoff | None:
        if flight.manifest is None:
            return None
        node = flight.prefill
        info = node.info if node is not None else None
        if info is None or info.pd.boot_id != flight.manifest.boot_id:
            raise NodeError("the prefill node restarted after holding the KV", "node_failed", culprit="prefill")
        return Handoff(manifest=flight.manifest, source=info.source(), choice_of=choice_of)

    async def _decode_on_some_node(self, body: DecodeBody, flight: _Flight, handle: RequestHandle,
                                   admitted: asyncio.Future, n_prompt: int) -> None:
        """Decode on the node the fleet picks; once more on another if that node was not
        reached or refused for load before admitting (it never saw the handoff, or said it
        will not pull it: prefill's rows are still held under the same lease)."""
        assert self.fleet is not None
        tried: set[str] = set(flight.avoid.get("decode", ()))
        while True:
            node = self.fleet.pick_decode(frozenset(tried), flight.manifest.seal_key if flight.manifest else None)
            if node is None:
                raise NodeError("no decode node is ready" + (" (tried " + ", ".join(sorted(tried)) + ")"
                                                               if tried else ""), "node_unavailable")
            flight.decode, flight.decode_contacted, flight.reader_stopped = node, False, False
            try:
                with _routed(node):
                    await self._decode(body, flight, handle, admitted, n_prompt, node)
                return
            except NodeError as e:
                retry = may_retry_decode(e.code, e.retryable, flight.decode_admitted, len(tried))
                if not retry or self.fleet.pick_decode(frozenset({node.url}), flight.manifest.seal_key
                                                       if flight.manifest else None) is None:
                    raise
                log.warning("request %s: decode on %s failed before admitting it (%s: %s); trying another decode node",
                            body.request_id, node.url, e.code, e)
                self.retries["decode"] += 1
                tried.add(node.url)

    async def forget_tenants(self, tenants: list[str], epoch: int) -> int:
        """Reload `epoch` of the tenants file retired these names: every node retires their
        cache scopes (prefill's cached prefix pages; on both roles the compiled grammars kept
        under them). A node that cannot be reached now retires them before it admits the
        first request stamped with the epoch (pd/scope_epochs.py); it is logged."""
        if not tenants or self.fleet is None:
            return 0
        bodies = [ForgetTenantsBody(tenants=tenants[i:i + MAX_TENANTS], router=self.router_id, epoch=epoch)
                  for i in range(0, len(tenants), MAX_TENANTS)]

        async def forget_on(node: Node) -> int:
            pages = 0
            if node.info is None:
                # never checked by this router process, so never sent one of its requests: it
                # holds nothing in this router's scopes (a node keeps each router's apart). An
                # unstamped message would have retired the name's plain scope instead
                return 0
            if faults.active("lose_forget_tenants"):
                log.warning("%s %s: the forget message is lost (fault lose_forget_tenants)", node.role, node.url)
                return 0
            try:
                for body in bodies:
                    r = await self._http().post(node.url + "/internal/forget_tenants",
                                                **_options(node, **_json(body, _stamps(node))))
                    if r.status_code != 200:
                        log.warning("%s %s did not retire removed tenants' cache scopes: HTTP %d", node.role,
                                    node.url, r.status_code)
                        break
                    pages += ForgetTenantsReply.from_json(r.content).pages
            except (httpx.HTTPError, MessageError) as e:
                log.warning("%s %s did not retire removed tenants' cache scopes: %s", node.role, node.url, e)
            return pages

        return sum(await asyncio.gather(*(forget_on(n) for n in self.fleet.nodes)))

    async def _settle_prefill(self, rid: str, flight: _Flight) -> None:
        """Tell prefill the request is over, and whether a pull of its rows can still run: if
        decode was contacted and did not say, ask it (it ends the request and answers), so
        rows decode never began to read are freed at once instead of fenced (I6)."""
        stopped = flight.reader_stopped or not flight.decode_contacted or flight.decode is None
        if not stopped:
            assert flight.decode is not None
            try:
                r = await self._http().post(flight.decode.url + "/internal/stop_pull",
                                            **_options(flight.decode, **_json(StopPullBody(request_id=rid))))
                stopped = r.status_code == 200 and StopPullReply.from_json(r.content).reader_stopped
            except (httpx.HTTPError, MessageError) as e:
                log.warning("decode did not say whether it still reads %s (%s): prefill fences its rows", rid, e)
        assert flight.prefill is not None
        await self._post(flight.prefill, "/internal/abort", AbortBody(
            request_id=rid, reader_stopped=stopped, reason="the request ended before decode verified the transfer"))

    async def _events(self, role: str, response: httpx.Response) -> AsyncIterator[Any]:
        """The node's NDJSON events, checked against their definitions; heartbeats dropped. A
        stream that breaks or goes silent is the node's failure, named (the client was told
        "a PD node failed mid-request: ReadTimeout"); it may have taken the request (I6)."""
        lines = response.aiter_lines()
        while True:
            try:
                text = await anext(lines, None)
            except httpx.TimeoutException:   # the read timeout is --node-stall; nodes beat every second
                raise NodeError(f"the {role} node sent nothing for {self.stall_s:g} s, not even its heartbeat",
                                "node_failed", maybe_taken=True, culprit=role) from None
            except httpx.HTTPError as e:     # killed or stopped mid-stream
                raise NodeError(f"the {role} node's stream broke off: {_described(e)}", "node_failed",
                                maybe_taken=True, culprit=role) from None
            if text is None:
                return
            if not text.strip():
                continue
            try:
                ev = parse_event(text)
            except MessageError as e:
                raise NodeError(f"the {role} node sent {e}", "node_error", maybe_taken=True, culprit=role) from None
            if not isinstance(ev, WaitEvent):
                yield ev

    async def _open(self, node: Node, path: str, body: WireModel, stack: AsyncExitStack) -> httpx.Response:
        role = node.role
        if isinstance(body, PrefillBody):   # and DecodeBody: only the boot the fleet checked may take it
            body = body.model_copy(update={"expect_boot": node.checked_boot})
        try:
            sent = _json(body, _stamps(node), _seal_keys(node), node.info is not None and node.info.choice_groups)
            r = await stack.enter_async_context(self._http().stream("POST", node.url + path, **_options(node, **sent)))
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:   # it never got the request: another may
            raise NodeError(f"the {role} node is unreachable: {_described(e)}", "node_unavailable",
                            retryable=True) from None
        except httpx.PoolTimeout:   # the router's own connections are all taken: nothing was sent
            raise NodeError(f"the router has no free connection to the {role} node (all "
                            f"{MAX_NODE_CONNECTIONS} in use)", "server_overloaded") from None
        except httpx.ReadTimeout:   # the read timeout is --node-stall
            raise NodeError(f"the {role} node took the request and sent nothing for {self.stall_s:g} s",
                            "node_failed", maybe_taken=True, culprit=role) from None
        except httpx.HTTPError as e:   # reached, then it died or hung before answering (killed, stopped)
            raise NodeError(f"the {role} node failed before answering: {_described(e)}", "node_failed",
                            maybe_taken=True, culprit=role) from None
        if r.status_code != 200:
            raw = await r.aread()
            err = _error_of(raw)
            if err is None:
                raise NodeError(f"{role} node answered {r.status_code}", "node_error")
            if err[1] == "not_ready" and self.fleet is not None:   # e.g. restarted since it was checked
                self.fleet.recheck(node, err[0])
            # a node refusing for load or state took nothing: another may take it
            raise NodeError(f"{role} node: {err[0]}", err[1] or "node_error",
                            retryable=(err[1] or "") in REFUSED_FOR_LOAD_OR_STATE)
        return r

    async def _admitted(self, role: str, events: AsyncIterator[Any]) -> AdmittedEvent:
        first = await anext(events, None)
        if isinstance(first, RejectedEvent):   # refused in the stream (HTTP 200): the same rule as above
            raise NodeError(f"{role} node: {first.message}", first.code, first,
                            retryable=first.code in REFUSED_FOR_LOAD_OR_STATE)
        if not isinstance(first, AdmittedEvent):
            what = "nothing" if first is None else first.event
            # whatever it did with the request is unknown: a decode node may be pulling (I6)
            raise NodeError(f"{role} node: expected admitted, got {what}", "node_error", maybe_taken=True,
                            culprit=role)
        return first

    async def _prefill(self, body: PrefillBody, flight: _Flight, node: Node) -> None:
        async with AsyncExitStack() as stack:
            events = self._events("prefill", await self._open(node, "/internal/prefill", body, stack))
            await self._admitted("prefill", events)
            async for ev in events:
                if isinstance(ev, ProgressEvent) and ev.event == "kv_held" and ev.manifest is not None:
                    flight.manifest = ev.manifest
                    if not flight.redone:
                        # a redo's prompt is in the cache because its first attempt computed it:
                        # the request's cached tokens are what that attempt found
                        flight.cached = ev.cached_tokens
                    if ev.started_ago_s is not None:   # the prompt's first step on prefill, on this clock
                        flight.started_at = time.perf_counter() - ev.started_ago_s
                    if faults.active("kill_node_at") and faults.arg("kill_node_at") == "router_after_prefill":
                        os._exit(137)
                    return
                if isinstance(ev, (ProgressEvent, FailedEvent)) and ev.finished:
                    raise NodeError(f"prefill failed: {ev.error or getattr(ev, 'finish_reason', None)}",
                                    ev.abort_code or "prefill_failed")
            raise NodeError("the prefill node closed the stream before holding the KV", "node_failed")

    async def _decode(self, body: DecodeBody, flight: _Flight, handle: RequestHandle, admitted: asyncio.Future,
                      n_prompt: int, node: Node) -> None:
        async with AsyncExitStack() as stack:
            flight.decode_contacted = True
            try:
                events = self._events("decode", await self._open(node, "/internal/decode", body, stack))
                await self._admitted("decode", events)
            except NodeError as e:
                if not e.maybe_taken:  # refused or never reached: it never pulls
                    flight.reader_stopped = True
                raise
            flight.decode_admitted = True
            # submit() returns, and the client's answer may begin, only once the KV is on decode
            # and verified: a request that waited there for pages and lost its lease, or whose
            # transfer failed, is then a plain 503 (which clients retry), not a 200 that ends in
            # an error; and the n choices of a request are all placed before any of them streams
            # (a probe: heavy n=16 answers broke off mid-stream with lease_expired)
            if body.handoff is None:   # decode computes the prompt itself: no transfer to wait for
                admitted.set_result(True)
            first_at = None
            async for ev in events:
                if isinstance(ev, FailedEvent):
                    raise NodeError(f"decode node: {ev.error}", ev.abort_code,
                                    culprit=culprit_of_decode_failure(ev.abort_code))
                if not isinstance(ev, ProgressEvent):
                    raise NodeError(f"decode node: unexpected {ev.event} event", "node_error")
                if ev.event == "kv_failed":
                    flight.reader_stopped = bool(ev.reader_stopped)
                if not admitted.done():
                    if ev.finished and ev.finish_reason not in ("stop", "length"):   # before anything was sent
                        raise NodeError(f"decode node: {ev.error or ev.finish_reason}", ev.abort_code or "node_error",
                                        culprit=culprit_of_decode_failure(ev.abort_code))
                    admitted.set_result(True)
                # it generates now (kvfence_tenant_sequences); not one that failed before it began
                # (a redo waits again)
                if flight.client_rid in self._tenant_of:
                    self._tenant_of[flight.client_rid][1] = True
                if ev.event == "kv_verified":
                    flight.released = True
                    assert flight.prefill is not None
                    self._later(self._post(flight.prefill, "/internal/release",
                                           ReleaseBody(request_id=body.request_id)))
                    continue
                now = time.perf_counter()
                toks = tuple(ev.token_ids)
                if toks and first_at is None:
                    first_at = now
                completion = flight.completion = ev.completion_tokens
                lps = tuple(Logprob(lp.token_id, lp.logprob, tuple(lp.top)) for lp in ev.logprobs)
                handle.updates.put_nowait(Update(
                    toks, ev.text, ev.finished, ev.finish_reason, ev.error, n_prompt, completion, flight.cached, lps,
                    first_at, (now,) * len(toks), ev.abort_code, started_at=flight.started_at))
                if ev.finished:
                    return
            raise NodeError("the decode node closed the stream mid-request", "node_failed", culprit="decode")


@contextmanager
def _routed(node: Node) -> Iterator[None]:
    """Count a request on a node while the router has it there (routing reads the counts)."""
    node.in_flight += 1
    node.routed += 1
    try:
        yield
    finally:
        node.in_flight -= 1


def _info_of(r: httpx.Response) -> tuple[NodeInfo | None, str | None]:
    """A node's /internal/info answer as its facts, or why it gave none."""
    if r.status_code == 401:   # what to do, not only what happened (an operator's rotation walkthrough)
        return None, ("refuses this router's cluster credential: the node must hold or accept (with "
                      "--accept-cluster-secret-file) the secret this router sends with (docs/pd.md, rotating)")
    if r.status_code != 200:
        return None, f"answered {_error_code(r.content) or r.status_code}"
    try:
        return NodeInfo.from_json(r.content), None
    except MessageError as e:
        return None, f"sent unusable facts ({e})"


def _url_list(urls: str | list[str]) -> list[str]:
    """Node URLs from repeated flags and/or comma-separated lists, without duplicates."""
    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        for u in item.split(","):
            u = u.strip().rstrip("/")
            if u and u not in out:
                out.append(u)
    return out


# engine counts that add up across nodes (the router's snapshot sums them)
_DECODE_SUMS = ("running", "capacity_tokens", "preemptions")
# every ready node's pool, prefill's too: its prefix cache and fenced rows were missing from the
# router's kvfence_kv_pages (found by an operator's-view probe)
_POOL_SUMS = ("pages_total", "pages_free", "pages_owned", "pages_shared", "pages_quarantined")


def _merge_snapshots(fleet: Fleet) -> dict:
    """The fleet's counts as one engine snapshot: KV pages by state summed over every ready
    node, requests running, pool capacity and preemptions over decode nodes (where requests
    generate), prefix-cache hits over prefill nodes, queues over every ready node, violations
    over all; the usable context is the fleet's; each node's own under nodes."""
    snaps = {n.url: n.info.snapshot for n in fleet.nodes if n.info is not None}
    ready = [(n.role, snaps[n.url]) for n in fleet.nodes if n.state == "ready" and n.url in snaps]
    out: dict[str, Any] = {k: sum(int(s.get(k, 0)) for r, s in ready if r == "decode") for k in _DECODE_SUMS}
    out.update({k: sum(int(s.get(k, 0)) for _, s in ready) for k in _POOL_SUMS})
    out["prefix_cache_hit_tokens"] = sum(int(s.get("prefix_cache_hit_tokens", 0)) for r, s in ready
                                         if r == "prefill")
    out["waiting"] = sum(int(s.get("waiting", 0)) for _, s in ready)
    out["tokens_computed"] = sum(int(s.get("tokens_computed", 0)) for _, s in ready)   # prefill's and decode's
    out["usable_context"] = fleet.usable_context
    violations: dict[str, int] = {}
    for s in snaps.values():
        for inv, c in (s.get("violations") or {}).items():
            violations[inv] = violations.get(inv, 0) + int(c)
    out["violations"] = violations
    out["nodes"] = snaps
    out["fleet"] = fleet.counts()
    out["fleet_changes"] = fleet.changes()
    # each node's pool as the isolation statement lists it (a router has none of its own)
    out["pools"] = [{"node": n.url, "role": n.role, "state": n.state, "pages": n.info.pool_pages,
                     "page_size_tokens": n.info.page_size, "capacity_tokens": n.info.pool_tokens,
                     "bytes": n.info.pool_bytes,
                     # the node's own usable context, as the capacity check (I8) reads it
                     "advertised_context_fits": fleet.usable_context <= n.info.usable_context}
                    for n in fleet.nodes if n.info is not None]
    return out


def _options(node: Node, **kw) -> dict[str, Any]:
    """httpx options for a request to `node` (its name as Host and TLS server name when it
    is one address of a name)."""
    return node.address.http_options(**kw) if node.address is not None else kw


# fields a node from before scope stamps does not know (NodeInfo.scope_stamps false): it
# refuses unknown fields, so during a rolling upgrade (router first) it gets the message without
STAMP_FIELDS = frozenset({"scope", "router", "epoch"})


def _json(body: WireModel, stamps: bool = True, seal_keys: bool = True, choice_groups: bool = True) -> dict[str, Any]:
    """An internal message as an httpx request's body; `stamps` False: for a node from before
    scope stamps; `seal_keys` False: for a decode node from before key ids (its handoff's
    manifest then names none; it opens rows with its one secret, as before); `choice_groups`
    False: for one from before Handoff.choice_of."""
    exclude: dict[str, Any] = {} if stamps else dict.fromkeys(STAMP_FIELDS & set(type(body).model_fields), True)
    if isinstance(body, DecodeBody) and body.handoff is not None:
        left_out: dict[str, Any] = {} if seal_keys else {"manifest": {"seal_key"}}
        if not choice_groups:
            left_out["choice_of"] = True
        if left_out:
            exclude["handoff"] = left_out
    return {"content": body.dumps(exclude or None), "headers": {"content-type": "application/json"}}


def _stamps(node: Node) -> bool:
    return node.info is not None and node.info.scope_stamps


def _seal_keys(node: Node) -> bool:
    return node.info is not None and node.info.seal_keys


def _error_of(raw: bytes) -> tuple[str, str | None] | None:
    """(message, code) of an error body in OpenAI's shape, or None."""
    try:
        err = json.loads(raw)["error"]
        return str(err["message"]), (str(err["code"]) if err.get("code") is not None else None)
    except (ValueError, KeyError, TypeError):
        return None


def _error_code(raw: bytes) -> str | None:
    err = _error_of(raw)
    return None if err is None else err[1]


def culprit_of_decode_failure(code: str | None) -> str | None:
    """The culprit of a failure decode itself reported: "transfer" when its read of the rows
    failed (TRANSFER_FAILURES: either end); else None (the request's own end, load, tampering)."""
    return "transfer" if code in TRANSFER_FAILURES else None


def _smallest(places: list[int | None]) -> int | None:
    """The least of (some) nodes' tenant_waiting_places (a request's choices wait together on
    prefill and on decode); None when a node does not say (from before the field)."""
    return None if None in places else min(p for p in places if p is not None)


def _as_submit_error(message: str, code: str, rejection: RejectedEvent | None) -> Exception:
    """What submit() raises before the request is admitted, in the shapes app.py maps to HTTP.
    A node's context-length refusal arrives with its numbers as fields."""
    r = rejection
    if code == "context_length_exceeded" and r is not None and None not in (r.limit, r.prompt_tokens, r.max_tokens):
        return ContextLengthExceeded(r.prompt_tokens, r.max_tokens, r.limit)  # type: ignore[arg-type]
    if code in ("invalid_request", "context_length_exceeded"):
        return ValueError(message)
    if code == "server_overloaded":   # answered as a single node's (503, outcome "overloaded", Retry-After)
        if r is None:   # the router's own (its connections to the nodes): internals, for the log
            log.warning("%s", message)
        # a node's own words name only the tenant's own count there ("overloaded for this tenant"):
        # relayed, the tenant can tell its share from a full cluster (a fairness probe: it got
        # "the operator's log has the details", and the router counted it as not_ready)
        return Overloaded(r.message if r is not None else "The server is overloaded; retry shortly.")
    return EngineFailed(message, code)


def serve_router(prefill_urls: list[str], decode_urls: list[str], model: str | None, host: str, port: int,
                 max_model_len: int | None, clamp_context: bool, secret: bytes | Keyring, tls: TlsSettings,
                 tenants_file: str | None = None,
                 served_model_name: str | None = None, log_level: str = "info", wait_s: float = 300.0,
                 stall_s: float = 10.0, limits: HttpLimits | None = None, prefill_routing: str = "affinity",
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, max_body_bytes: int | None = None) -> int:
    from kvfence.server import fault_control
    from kvfence.server.app import DEFAULT_MAX_BODY_BYTES, ServerState, create_app, detail_withheld, may_scrape
    from kvfence.server.serve import load_tenants, refuse_unusable_port

    tenants = load_tenants(tenants_file)
    refused = refuse_unusable_port(host, port, "router")   # before waiting up to --node-wait for the nodes
    if refused is not None:
        return refused
    backend = RouterBackend(prefill_urls, decode_urls, secret, tls, model, max_model_len, clamp_context, wait_s,
                            stall_s, prefill_routing=prefill_routing).start()
    if backend.error is not None:
        log.error("router not serving: %s", backend.error)
        return 2
    state = ServerState(backend, tenants, served_model_name, max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    app = create_app(state)
    if faults.announce(log):   # as a node's start-up check records it: the report must see it (review)
        faults.record_active()
    state.keyring = backend.keyring   # SIGHUP reads its secret file again
    fault_control.mount(app, backend.keyring)
    log.info("router: sends the cluster credential of the secret with key id %s",
             key_id(backend.keyring.current.own))

    @app.get("/v1/kvfence/cluster")
    async def cluster(request: Request):
        body = {"ready": backend.state == "ready",
                "usable_context": backend.facts["usable_context"] if backend.facts else None}
        if not may_scrape(state, request, "/v1/kvfence/cluster", public_part=True):
            # with a tenants file, where the nodes are, how loaded each is and why one was
            # refused are the operator's: a tenant learns only whether the service is up
            withheld = detail_withheld(state, request)   # the right key from a throttled address
            return {**body, "detail": "per-node state needs the tenants file's [metrics] or [operator] key "
                                      "('Authorization: Bearer <key>')" if withheld is None else
                    f"per-node state withheld: {withheld}"}
        return {**body, "error": backend.error, "check": backend.check.to_json() if backend.check else None,
                # the secret this router sends with now (pd/seal.py key ids)
                "secret_key_id": key_id(backend.keyring.current.own),
                "nodes": backend.fleet.to_json() if backend.fleet else []}

    # SIGTERM: what is in flight may finish for --shutdown-timeout, then ends with 503
    # server_shutting_down (server/shutdown.py)
    nodes = f'prefill {", ".join(backend.urls["prefill"])}; decode {", ".join(backend.urls["decode"])}'
    server = uvicorn_server(app, host, port, limits or HttpLimits(), log_level, refusals=state.metrics.connections,
                            listening=lambda scheme, bound: log.info("router serving model %r on %s://%s:%d/v1 (%s)",
                                                                     state.served_name, scheme, host, bound, nodes),
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S,
                            **uvicorn_options(tls, client_certificates=False))
    GracefulStop(server, backend, shutdown_timeout_s).install()
    server.run()
    return 0
