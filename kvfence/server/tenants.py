"""Tenants: API keys -> tenant, and per-tenant limits.

The tenants file is TOML:

    [defaults]                      # optional; applies to every tenant unless it overrides
    max_concurrent_requests = 16

    [tenants.acme]
    api_keys = ["sk-acme-..."]      # or api_key_sha256 = ["<hex digest>"] to keep keys out of the file
    max_prompt_tokens = 4096        # a cap below the engine's context
    max_concurrent_requests = 8
    tokens_per_minute = 200000      # prompt + completion tokens in any 60 s window
    requests_per_minute = 600       # requests taken in any 60 s window (not those refused by it or by
                                    # the concurrency limit; those refused later, by their body, do count)
    public_prefix_scope = "docs-v1" # optional opt-in: share cached prompt prefixes with the other
                                    # tenants that name the same scope (default: own tenant only)

    [metrics]                       # optional: the key a Prometheus scraper sends for /metrics
    api_keys = ["..."]              # (or api_key_sha256); the [operator] key reads it too

/metrics names every tenant and counts its requests and tokens, so with a tenants file it is
served only to the [metrics] or [operator] key, never to a tenant's key or to no key; without
a tenants file (one tenant, "default") it stays open.

Keys are kept only as SHA-256 digests and compared with hmac.compare_digest against every
stored digest (no early exit), so neither the comparison nor which key matched shows in the
timing. Keys are never logged. Without a tenants file the server is single-tenant: every
request belongs to tenant "default" and no key is checked.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import math
import re
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from kvfence.kv.ledger import TENANT_NAME
from kvfence.server.errors import APIError

DEFAULT_TENANT = "default"
UNAUTHENTICATED = "unauthenticated"     # the metrics' tenant label of a request refused before its key
RESERVED_NAMES = frozenset({UNAUTHENTICATED})
# what a client can send in a header as written: printable ASCII, and spaces only inside (the
# header is stripped, so an outer one could never match)
_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
LIMIT_FIELDS = ("max_prompt_tokens", "max_concurrent_requests", "tokens_per_minute", "requests_per_minute",
                "default_max_tokens")
_NAME = re.compile(TENANT_NAME)
WINDOW_S = 60.0
MAX_FILE_BYTES = 64 << 20


class TenantsFileError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int | None = None
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    # requests taken in any 60 s: each one costs the server its parse, template and tokenize
    # (and a PD router a prefill and a handoff) whatever it generates, which tokens_per_minute
    # does not see: a flood of tiny or hung-up requests stayed under it (found in a probe)
    requests_per_minute: int | None = None
    default_max_tokens: int | None = None   # the completion limit of a request that sets none


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: Limits = field(default_factory=Limits)
    public_prefix_scope: str | None = None   # opt-in cross-tenant prefix sharing (I9); None: own scope only
    # the reload of this process that last retired the name's cache scope (0: none); a PD router
    # stamps the tenant's requests with it (kvfence/pd/scope_epochs.py)
    scope_epoch: int = 0


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def prompt_cap_refusal(cap: int, has: str, param: str) -> APIError:
    """The tenant's max_prompt_tokens refusal. Not a rate limit: retrying cannot help, so 400
    (the client's retry logic stays out of it)."""
    # worded as a context overflow: it is this key's context, and clients (LiteLLM) tell one by
    # OpenAI's opening words, to fall back to a model with a larger one
    return APIError(400, f"This model's maximum context length is {cap} prompt tokens for this API key (its "
                         f"max_prompt_tokens): it may send at most {cap} prompt tokens per request; {has}.",
                    code="tenant_max_prompt_tokens", param=param, outcome="rejected")


class TenantFacts(NamedTuple):
    """What the isolation statement says of the tenants as a whole."""
    public_scopes: list[str]   # declared public prefix scopes
    opted_in: int              # tenants opted into one
    prompt_caps: list[int]     # distinct max_prompt_tokens


class TenantRegistry:
    """Who is calling. `authenticate()` maps an Authorization header to a Tenant or raises 401."""

    def __init__(self, tenants: list[tuple[Tenant, list[bytes]]] | None = None, source: str | None = None):
        self.single_tenant = tenants is None
        self.source = source
        self.operator_digests: list[bytes] = []
        # [metrics]: a scraper's key: /metrics, /health's detail, the router's per-node state and
        # the whole isolation statement (what describes every tenant); never generation or the console
        self.metrics_digests: list[bytes] = []
        self.disclosure: dict = {}
        self.reloads = 0                       # how many reloads led to this registry
        self.scope_epochs: dict[str, int] = {}   # name -> the reload that last retired it (gone names too)
        self._entries: list[tuple[bytes, Tenant]] = []
        self.tenants: dict[str, Tenant] = {}
        if tenants is None:
            self.tenants[DEFAULT_TENANT] = Tenant(DEFAULT_TENANT)
            return
        for tenant, digests in tenants:
            self.tenants[tenant.name] = tenant
            self._entries += [(d, tenant) for d in digests]
        self._owner_of = {d: t.name for d, t in self._entries}   # for accepts (no caller times it)

    @functools.cached_property
    def facts(self) -> TenantFacts:
        """For the isolation statement, which any tenant may read. Walked once per registry (a
        reload makes a new one): walking 100K tenants a read took ~50 ms of the event loop
        (found in review)."""
        public = sorted({t.public_prefix_scope for t in self.tenants.values() if t.public_prefix_scope})
        opted = sum(1 for t in self.tenants.values() if t.public_prefix_scope)
        caps = sorted({t.limits.max_prompt_tokens for t in self.tenants.values()
                       if t.limits.max_prompt_tokens is not None})
        return TenantFacts(public, opted, caps)

    @classmethod
    def single(cls) -> TenantRegistry:
        return cls(None)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        path = Path(path)
        try:
            # a regular file of sane size: a FIFO or a device would hang a reload for good
            if path.exists() and (not path.is_file() or path.stat().st_size > MAX_FILE_BYTES):
                raise TenantsFileError(f"tenants file {path} is not a regular file of at most "
                                       f"{MAX_FILE_BYTES >> 20} MiB")
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TenantsFileError(f"tenants file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TenantsFileError(f"tenants file {path} is not valid TOML: {e}") from None
        except OSError as e:   # unreadable (permissions, a directory's race): a clear error, not a traceback
            raise TenantsFileError(f"tenants file {path} cannot be read: {e.strerror or e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str | None = None) -> TenantRegistry:
        where = source or "tenants file"
        unknown = set(data) - {"defaults", "tenants", "operator", "metrics", "disclosure"}
        if unknown:
            raise TenantsFileError(f"{where}: unknown top-level section(s) {sorted(unknown)}; "
                                   f"expected [defaults], [tenants.NAME], [operator], [metrics] and [disclosure]")
        defaults = _limits(data.get("defaults", {}), f"{where} [defaults]", Limits())
        tenants = data.get("tenants")
        if not isinstance(tenants, dict) or not tenants:
            raise TenantsFileError(f"{where}: no tenants; add at least one [tenants.NAME] table with api_keys")
        out: list = []
        seen: dict[bytes, str] = {}
        for name, spec in tenants.items():
            here = f"{where} [tenants.{name}]"
            if not _NAME.fullmatch(name):
                raise TenantsFileError(f"{here}: tenant names are 1-64 characters of A-Z a-z 0-9 _ . -")
            if name in RESERVED_NAMES:
                raise TenantsFileError(f"{here}: {name!r} is reserved (the metrics count requests refused "
                                       "before a tenant is known under it); choose another name")
            if not isinstance(spec, dict):
                raise TenantsFileError(f"{here}: must be a table")
            bad = set(spec) - {"api_keys", "api_key_sha256", "public_prefix_scope", *LIMIT_FIELDS}
            if bad:
                raise TenantsFileError(f"{here}: unknown field(s) {sorted(bad)}")
            digests = _key_digests(spec, here)
            for d in digests:
                if d in seen:
                    # never print the key itself, only which tenants share it
                    raise TenantsFileError(f"{here}: an API key is also given to tenant {seen[d]!r}")
                seen[d] = name
            scope = spec.get("public_prefix_scope")
            if scope is not None and not (isinstance(scope, str) and _NAME.fullmatch(scope)):
                raise TenantsFileError(f"{here}: public_prefix_scope is 1-64 characters of A-Z a-z 0-9 _ . -")
            out.append((Tenant(name, _limits(spec, here, defaults), scope), digests))
        reg = cls(out, source)
        reg.operator_digests = _operator(data.get("operator"), f"{where} [operator]", seen)
        reg.metrics_digests = _operator(data.get("metrics"), f"{where} [metrics]", seen)
        if set(reg.metrics_digests) & set(reg.operator_digests):
            # a scraper's key sits in a Prometheus config; it must not also open the console
            raise TenantsFileError(f"{where} [metrics]: its key is also the [operator] key; give the scraper its "
                                   "own key (the operator key reads /metrics anyway)")
        reg.disclosure = _disclosure(data.get("disclosure"), f"{where} [disclosure]")
        return reg

    def is_operator(self, authorization: str | None) -> bool:
        """The operator's credential (constant time over every operator digest); never a
        tenant's key, and nobody's without a tenants file that names one."""
        return _matches(authorization, self.operator_digests)

    def may_scrape(self, authorization: str | None) -> bool:
        """Whether /metrics may be served: always without a tenants file (one tenant); with one,
        only to the [metrics] or the [operator] key (its series name every tenant)."""
        if self.single_tenant:
            return True
        return _matches(authorization, self.metrics_digests + self.operator_digests)

    def is_tenant_key(self, authorization: str | None) -> bool:
        try:
            self.authenticate(authorization)
        except APIError:
            return False
        return True

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.identify(authorization)[0]

    def identify(self, authorization: str | None) -> tuple[Tenant, bytes | None]:
        """The tenant and the digest of the key that named it (None without a tenants file):
        a request keeps the digest, so that a reload that revokes the key ends it."""
        if self.single_tenant:
            return self.tenants[DEFAULT_TENANT], None
        key = _bearer(authorization)
        if key is None:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
        presented = _digest(key)
        found = None
        for digest, tenant in self._entries:  # every entry, no early exit
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found, presented

    def accepts(self, key: bytes | None, tenant: str) -> bool:
        """Whether `key` (a digest from identify) still names `tenant` here: false once the key
        is gone, or given to another tenant, or the tenant is."""
        # a dict, not the constant-time scan: a reload checks every request in flight on the
        # event loop, and only the operator's reload waits for the answer
        return self.single_tenant or (key is not None and self._owner_of.get(key) == tenant)

    def succeed(self, old: TenantRegistry, retired: list[str]) -> None:
        """This registry replaces `old` by a reload that retires `retired`: number the reload,
        and give every tenant its name's scope epoch (carried over, or this reload's)."""
        self.reloads = old.reloads + 1
        self.scope_epochs = {**old.scope_epochs, **dict.fromkeys(retired, self.reloads)}
        epoch = {n: self.scope_epochs.get(n, 0) for n in self.tenants}
        self.tenants = {n: replace(t, scope_epoch=epoch[n]) for n, t in self.tenants.items()}
        self._entries = [(d, self.tenants[t.name]) for d, t in self._entries]

    def context_notes(self, usable_context: int) -> list[str]:
        """Prompt caps the server's context makes moot, for the log once the context is known
        (at start, after the model or the nodes; at reload). One line, however many tenants."""
        # the file cannot know the model's context: a cap at or beyond it was taken without a
        # word, and its tenant's model card showed a cap the server never applies
        moot = sorted(t.name for t in self.tenants.values()
                      if t.limits.max_prompt_tokens is not None and t.limits.max_prompt_tokens >= usable_context)
        if not moot:
            return []
        names = ", ".join(repr(n) for n in moot[:10]) + (f" and {len(moot) - 10} more" if len(moot) > 10 else "")
        return [f"max_prompt_tokens of tenant(s) {names} is at least this server's context of {usable_context} "
                f"tokens (prompt plus completion): the cap has no effect, their prompts of {usable_context} tokens "
                f"or more are refused as context_length_exceeded; set it below {usable_context}"]

    def notes(self) -> list[str]:
        """Limits that are valid but likely to surprise, for the log at start and at reload."""
        out = []
        for t in self.tenants.values():
            tpm = t.limits.tokens_per_minute
            if tpm is not None and t.limits.default_max_tokens is None:
                # found by a probe: at tpm 1000, requests of ~100 tokens got 429 for a minute
                out.append(f"tenant {t.name!r} has tokens_per_minute {tpm} and no default_max_tokens: a chat or "
                           f"Responses request that sets no max_tokens reserves up to all {tpm} (its unused "
                           "tokens are refunded when it ends), so a second one waits; set default_max_tokens "
                           "to what such an answer needs")
        return out

    def reread(self) -> TenantRegistry:
        """The registry its file says now (TenantsFileError if the file is wrong: the caller
        keeps this one)."""
        if self.source is None:
            raise TenantsFileError("no tenants file to reload: this server is single-tenant (start it with "
                                   "--tenants FILE to serve several tenants)")
        return TenantRegistry.from_file(self.source)


def _as_filed(t: Tenant) -> Tenant:
    """What the tenants file says of a tenant: its scope epoch is the reloads', not the file's."""
    return replace(t, scope_epoch=0)


def registry_change(old: TenantRegistry, new: TenantRegistry) -> dict:
    """What a reload changed, for the operator's log and the reload route's answer: tenant
    names and counts, never a key or a digest."""
    def keys(reg: TenantRegistry) -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for d, t in reg._entries:
            out.setdefault(t.name, set()).add(d)
        return out

    was, now = keys(old), keys(new)
    kept = sorted(set(old.tenants) & set(new.tenants))
    removed = sorted(set(old.tenants) - set(new.tenants))
    return {"tenants": len(new.tenants),
            "added": sorted(set(new.tenants) - set(old.tenants)),
            "removed": removed,
            # a kept name whose keys are all new is another party under the old name (or a
            # rotation of every key at once): its cache goes with the old keys
            "retired": removed + [n for n in kept if was.get(n) and now.get(n) and not was[n] & now[n]],
            "changed": [n for n in kept if _as_filed(old.tenants[n]) != _as_filed(new.tenants[n])
                        or was.get(n) != now.get(n)],
            "keys_revoked": sum(len(d - now.get(n, set())) for n, d in was.items()),
            "keys_added": sum(len(d - was.get(n, set())) for n, d in now.items()),
            "operator_keys_changed": set(old.operator_digests) != set(new.operator_digests),
            "metrics_keys_changed": set(old.metrics_digests) != set(new.metrics_digests)}


DISCLOSURE_FIELDS = {"contact": str, "postmortems": str, "notification_window_hours": int}


def _key_digests(spec: dict, where: str) -> list[bytes]:
    """The SHA-256 digests of a table's api_keys and api_key_sha256 (at least one)."""
    digests = []
    for key in _str_list(spec.get("api_keys", []), f"{where} api_keys"):
        if len(key) < 8:
            raise TenantsFileError(f"{where}: an API key is shorter than 8 characters")
        if not _KEY.fullmatch(key):
            # the header is stripped and read as ASCII, so such a key could never match: refuse it now
            raise TenantsFileError(f"{where}: an API key has a character other than printable ASCII, or begins "
                                   "or ends with a space (tabs, non-ASCII letters and outer spaces cannot be "
                                   "sent in a Bearer header as written)")
        digests.append(_digest(key))
    for hx in _str_list(spec.get("api_key_sha256", []), f"{where} api_key_sha256"):
        if not re.fullmatch(r"[0-9a-fA-F]{64}", hx):
            raise TenantsFileError(f"{where}: api_key_sha256 entries are 64 hex digits")
        digests.append(bytes.fromhex(hx))
    if not digests:
        raise TenantsFileError(f"{where}: needs api_keys or api_key_sha256")
    return digests


def _operator(spec, where: str, tenant_keys: dict[bytes, str]) -> list[bytes]:
    """The digests of a key-only table ([operator], [metrics]); none of them a tenant's key."""
    if spec is None:
        return []
    if not isinstance(spec, dict) or set(spec) - {"api_keys", "api_key_sha256"}:
        raise TenantsFileError(f"{where}: a table with api_keys or api_key_sha256 only")
    digests = _key_digests(spec, where)
    for d in digests:
        if d in tenant_keys:
            raise TenantsFileError(f"{where}: its key is also tenant {tenant_keys[d]!r}'s")
    return digests


def _matches(authorization: str | None, digests: list[bytes]) -> bool:
    """Whether the bearer key is one of `digests`: compared with every one, no early exit."""
    key = _bearer(authorization)
    if key is None or not digests:
        return False
    presented = _digest(key)
    found = False
    for d in digests:
        found |= hmac.compare_digest(presented, d)
    return found


def _disclosure(spec, where: str) -> dict:
    if spec is None:
        return {}
    if not isinstance(spec, dict) or set(spec) - set(DISCLOSURE_FIELDS):
        raise TenantsFileError(f"{where}: fields are {', '.join(DISCLOSURE_FIELDS)}")
    for k, typ in DISCLOSURE_FIELDS.items():
        v = spec.get(k)
        if v is not None and (not isinstance(v, typ) or isinstance(v, bool) or (isinstance(v, int) and v < 1)
                              or (isinstance(v, str) and not v.strip())):
            raise TenantsFileError(f"{where}: {k} must be {'a positive integer' if typ is int else 'a string'}")
    return dict(spec)


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return None
    return value


def _str_list(v, where: str) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise TenantsFileError(f"{where}: must be a list of non-empty strings")
    return v


def _limits(spec: dict, where: str, base: Limits) -> Limits:
    if not isinstance(spec, dict):
        raise TenantsFileError(f"{where}: must be a table")
    values = {}
    for name in LIMIT_FIELDS:
        v = spec.get(name, getattr(base, name))
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise TenantsFileError(f"{where}: {name} must be a positive integer")
        values[name] = v
    if where.endswith("[defaults]"):
        bad = set(spec) - set(LIMIT_FIELDS)
        if bad:
            raise TenantsFileError(f"{where}: unknown field(s) {sorted(bad)}")
    return Limits(**values)


class Lease:
    """One admitted request's hold on its tenant's concurrency slot and on the tokens it may
    use this minute (prompt + max_tokens, reserved at admission); release exactly once, with
    the completion tokens it really produced: the rest is refunded.

    It also stands for the request when the tenants file is reloaded: a lease whose key no
    longer names its tenant is revoked, and `on_revoke` (set once the request runs) ends it."""

    def __init__(self, limiter: TenantLimiter, tenant: Tenant, key: bytes | None = None):
        self._limiter, self.tenant, self.key, self._open = limiter, tenant, key, True
        self.prompt_tokens = 0     # set by TenantLimiter.charge
        self._entry: list | None = None   # [time, tokens] in the tenant's window, while it has a TPM limit
        self.revoked = False
        self.on_revoke: Callable[[], None] | None = None

    def release(self, completion_tokens: int = 0) -> None:
        if self._open:
            self._open = False
            self._limiter._release(self, completion_tokens)

    def revoke(self) -> None:
        if not self.revoked:
            self.revoked = True
            if self.on_revoke is not None:
                self.on_revoke()


def _rate(what: str, limit: int, used: int, newest: float | None, now: float) -> dict[str, str]:
    reset = 0.0 if newest is None else max(0.0, newest + WINDOW_S - now)
    return {f"x-ratelimit-limit-{what}": str(limit), f"x-ratelimit-remaining-{what}": str(max(0, limit - used)),
            f"x-ratelimit-reset-{what}": f"{math.ceil(reset)}s"}   # OpenAI writes durations so: "6m0s", "1s"


class TenantLimiter:
    """Per-tenant prompt cap (400), concurrency, requests and tokens per minute (429 with
    Retry-After)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._used: dict[str, deque[list]] = {}   # tenant -> [time, tokens] entries, oldest first
        self._taken: dict[str, deque[list]] = {}    # tenant -> [time, 1] per request taken, oldest first
        self._open: set[Lease] = set()              # every lease not yet released

    def forget(self, tenants: list[str]) -> None:
        """Names retired by a reload: their tokens-per-minute window starts empty, so another
        party under the name neither inherits the old one's usage nor reads it in a 429."""
        with self._lock:
            for name in tenants:
                self._used.pop(name, None)
                self._taken.pop(name, None)

    def revoke_unless(self, still_valid: Callable[[Lease], bool]) -> int:
        """Revoke every open lease that `still_valid` refuses (a reload's check of its key);
        returns how many. The callbacks run here, on the caller's thread (the event loop)."""
        with self._lock:
            gone = [lease for lease in self._open if not lease.revoked and not still_valid(lease)]
        for lease in gone:
            lease.revoke()
        return len(gone)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def tokens_in_window(self, tenant: str) -> int:
        with self._lock:
            return self._window(tenant, self._clock())[0]

    def _window(self, tenant: str, now: float, store: dict[str, deque[list]] | None = None) -> tuple[int, deque]:
        """The tenant's [time, amount] entries of the last minute (tokens; `store` self._taken:
        requests, an amount of 1 each), older ones dropped, and their total."""
        used = (self._used if store is None else store).setdefault(tenant, deque())
        while used and used[0][0] <= now - WINDOW_S:
            used.popleft()
        return sum(n for _, n in used), used

    def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int = 0) -> Lease:
        """hold() and charge() in one: a slot, the prompt cap and the tokens reserved."""
        lease = self.hold(tenant)
        try:
            self.charge(lease, prompt_tokens, max_tokens)
        except APIError:
            lease.release()
            raise
        return lease

    def hold(self, tenant: Tenant, key: bytes | None = None) -> Lease:
        """A concurrency slot only. Generation takes it as soon as the key is known, so parsing,
        templating and tokenizing run inside the tenant's limit; /tokenize and /detokenize stop
        here (they generate nothing: no prompt cap, no tokens_per_minute). Each one taken counts
        against requests_per_minute; one refused here does not."""
        with self._lock:
            self._check_slot(tenant)
            self._count_request(tenant)
            self._in_flight[tenant.name] = self.in_flight(tenant.name) + 1
            lease = Lease(self, tenant, key)
            self._open.add(lease)
        return lease

    @staticmethod
    def largest_max_tokens(tenant: Tenant, prompt_tokens: int, completions: int) -> int | None:
        """The largest max_tokens per completion that charge() could ever pass for these prompt
        tokens and this many completions (None: no tokens_per_minute): what an empty minute
        holds after the prompts, shared evenly."""
        tpm = tenant.limits.tokens_per_minute
        return None if tpm is None else (tpm - prompt_tokens) // max(1, completions)

    def charge(self, lease: Lease, prompt_tokens: int, max_tokens: int = 0, param: str = "max_tokens",
               prompt_param: str = "prompt") -> None:
        """Once the prompt is tokenized: the prompt cap (400), and with tokens_per_minute a
        reservation of prompt + max_tokens, the most the request can use (429 while the window
        is full); release() refunds what it did not use."""
        tenant = lease.tenant
        lim = tenant.limits
        need = prompt_tokens + max_tokens
        if lim.max_prompt_tokens is not None and prompt_tokens > lim.max_prompt_tokens:
            raise prompt_cap_refusal(lim.max_prompt_tokens, f"this request has {prompt_tokens} prompt tokens",
                                     prompt_param)
        with self._lock:
            assert lease._open and lease._entry is None, "charge a held lease once"
            now = self._clock()
            if lim.tokens_per_minute is not None:
                if need > lim.tokens_per_minute:   # it could never pass: not a rate limit
                    raise APIError(400, f"This request may use {need} tokens ({prompt_tokens} in the prompt, "
                                        f"{max_tokens} to complete), more than the {lim.tokens_per_minute} tokens "
                                        f"per minute this API key may use; send a shorter prompt or a lower "
                                        f"{param}.",
                                   code="tenant_tokens_per_minute", param=param, outcome="rejected")
                total, used = self._window(tenant.name, now)
                if total + need > lim.tokens_per_minute:
                    wait = self._wait_for(used, total + need - lim.tokens_per_minute, now)
                    raise APIError(429, f"Rate limit reached: this API key may use {lim.tokens_per_minute} tokens "
                                        f"per minute; {total} used or reserved in the last minute, this request "
                                        f"may need {need} more. Try again in {wait} s.",
                                   code="tenant_tokens_per_minute", headers={"Retry-After": str(wait)})
                lease._entry = [now, need]
                used.append(lease._entry)
            lease.prompt_tokens = prompt_tokens

    def _check_slot(self, tenant: Tenant) -> None:
        most = tenant.limits.max_concurrent_requests
        if most is not None and self.in_flight(tenant.name) >= most:
            raise APIError(429, f"Too many concurrent requests: this API key may have {most} in flight.",
                           code="tenant_max_concurrent_requests", headers={"Retry-After": "1"})

    def rate_headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's per-minute limits it has (none for
        one without): the limit, what is left of it now, and how long until the window is
        empty again. Clients and proxies (LiteLLM, LangChain's limiters) pace themselves on
        them. Only the tenant's own counts."""
        out: dict[str, str] = {}
        lim = tenant.limits
        with self._lock:
            now = self._clock()
            if lim.requests_per_minute is not None:
                count, taken = self._window(tenant.name, now, self._taken)
                out.update(_rate("requests", lim.requests_per_minute, count, taken[-1][0] if taken else None, now))
            if lim.tokens_per_minute is not None:
                total, used = self._window(tenant.name, now)
                out.update(_rate("tokens", lim.tokens_per_minute, total, used[-1][0] if used else None, now))
        return out

    def requests_in_window(self, tenant: str) -> int:
        with self._lock:
            return self._window(tenant, self._clock(), self._taken)[0]

    def _count_request(self, tenant: Tenant) -> None:
        """Under the lock: 429 when the tenant took requests_per_minute requests in the last
        60 s, else count this one."""
        most = tenant.limits.requests_per_minute
        if most is None:
            return
        now = self._clock()
        count, taken = self._window(tenant.name, now, self._taken)
        if count >= most:
            wait = self._wait_for(taken, count - most + 1, now)   # until one more fits
            raise APIError(429, f"Rate limit reached: this API key may make {most} requests per minute; try again "
                                f"in {wait} s.", code="tenant_requests_per_minute", headers={"Retry-After": str(wait)})
        taken.append([now, 1])

    @staticmethod
    def _wait_for(used: deque, excess: int, now: float) -> int:
        freed = 0
        for t, n in used:
            freed += n
            if freed >= excess:
                return max(1, math.ceil(t + WINDOW_S - now))
        return int(WINDOW_S)

    def _release(self, lease: Lease, completion_tokens: int) -> None:
        with self._lock:
            self._open.discard(lease)
            name = lease.tenant.name
            self._in_flight[name] = max(0, self.in_flight(name) - 1)
            if lease._entry is not None:   # the reservation becomes what was used
                lease._entry[1] = min(lease._entry[1], lease.prompt_tokens + completion_tokens)
