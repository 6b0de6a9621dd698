"""Every message that crosses between the PD router and its nodes, one typed definition each.

The router builds them, the nodes parse them (and the other way round for events and node
info); the canary harness, the benches and the simulator use the same definitions. Each is
a strict pydantic model: exact JSON types (an int field refuses 39.0 and "39", a bool
refuses 1), ranges and lengths bounded, unknown fields refused, NaN and infinities refused.
`from_json` raises `MessageError` (a ValueError) naming every field that is wrong, so a
node answers a malformed message with a 400 before anything is admitted.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from kvfence.engine.params import (
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_ID,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from kvfence.kv.ledger import TENANT_NAME

# bounds: generous for any real request, small enough that no field can make a node
# allocate or loop without limit
MAX_ID = 128                  # request ids, boot ids
MAX_NAME = 256                # tenant and scope names, sessions, fingerprints
MAX_TEXT = 4096               # reasons and error messages
MAX_PROMPT_IDS = 1 << 20      # a prompt's token ids
MAX_TOKEN_ID = (1 << 31) - 1
MAX_PAGES = 1 << 20           # pages of one handoff
MAX_TENANTS = 1 << 16         # tenant names in one message
U64 = (1 << 64) - 1

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
# a tenant or public prefix scope as the tenants file names it, and a router process's id:
# the parts of a node's cache-scope keys (ledger.scope_name), so none can hold its separators
ScopePart = Annotated[str, Field(pattern=f"^{TENANT_NAME}$")]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Count = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class MessageError(ValueError):
    """A message that does not match its definition; the text names each bad field."""


M = TypeVar("M", bound="WireModel")


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:8]:
        where = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{where}: {err['msg']}")
    more = e.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def dumps(self, exclude: set[str] | dict[str, Any] | None = None) -> bytes:
        return self.model_dump_json(exclude=exclude).encode()

    @classmethod
    def from_json(cls: type[M], data: Any) -> M:
        """From a decoded JSON value (dict) or raw JSON text/bytes."""
        try:
            if isinstance(data, (bytes, bytearray, str)):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise MessageError(f"malformed {cls.__name__}: {_explain(e)}") from None


# -- sampling parameters -------------------------------------------------------------------
class WireParams(WireModel):
    """SamplingParams as they cross the wire (SamplingParams itself checks the ranges)."""
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)] = 0
    seed: Annotated[int, Field(ge=-(1 << 63), le=U64)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKEN_ID)] | None = 16
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=64)] = []
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=MAX_STOP_TOKEN_ID)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=2.0)] = 1.0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)] = 0
    # JSON object keys are strings: token ids as decimal strings
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                               Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] = {}
    # structured output (response_format) as compact JSON: decode samples every output token, so
    # the schema travels with the request; bound as params.MAX_JSON_SCHEMA_BYTES (64 KiB)
    json_schema: Annotated[str, Field(min_length=2, max_length=64 << 10)] | None = None

    @classmethod
    def of(cls, p: SamplingParams) -> WireParams:
        return cls(temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k, seed=p.seed,
                   max_tokens=p.max_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                   ignore_eos=p.ignore_eos, logprobs=p.logprobs, skip_special_tokens=p.skip_special_tokens,
                   include_stop_str_in_output=p.include_stop_str_in_output,
                   presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
                   repetition_penalty=float(p.repetition_penalty), min_p=float(p.min_p), min_tokens=p.min_tokens,
                   logit_bias={str(k): float(v) for k, v in p.logit_bias.items()},
                   json_schema=None if p.json_schema is None else str(p.json_schema))

    def to_params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())


# -- the handoff manifest ------------------------------------------------------------------
class Manifest(WireModel):
    """What prefill says about a hold (kvfence/pd/manifest.py holds decode's checks of it).
    It names no address to pull from: decode pulls from the TransferSource the router read
    from the prefill node itself."""
    request_id: Id
    tenant: ScopePart
    token_count: Count                # tokens whose KV the pages hold: all the prompt but its last token
    page_count: Annotated[int, Field(ge=0, le=MAX_PAGES)]
    page_size: Annotated[int, Field(ge=1, le=1 << 16)]
    epochs: Annotated[list[Annotated[int, Field(ge=0, le=U64)]], Field(max_length=MAX_PAGES)]
    fingerprint: Name                 # model architecture (ModelConfig.fingerprint)
    layout: Name                      # KV layout and dtype of the page bytes
    boot_id: Id                       # the prefill process: a restarted one has another
    seal_salt: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]   # per hold: with the secret, the rows' key
    # which cluster secret sealed them (seal.key_id); None: a prefill from before key ids,
    # which sealed with the one secret of its cluster (decode then uses its own)
    seal_key: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")] | None = None
    slot_bytes: Annotated[int, Field(ge=1, le=1 << 40)]
    slots: Annotated[list[Annotated[int, Field(ge=0, le=MAX_PAGES)]], Field(max_length=MAX_PAGES)]
    lease_deadline: float             # time.time() after which no pull may start
    issued_at: float = 0.0

    def model_post_init(self, _context: Any) -> None:
        if not (len(self.epochs) == len(self.slots) == self.page_count):
            raise ValueError(f"manifest lists {len(self.slots)} slots and {len(self.epochs)} epochs for "
                             f"{self.page_count} pages")


class TransferSource(WireModel):
    """Where decode pulls a handoff from: the prefill node's transfer engine and registered
    buffer as that node reported them to the router (GET /internal/info), never as a
    manifest says."""
    session: Name                     # the transfer engine, host:port
    base: Annotated[int, Field(ge=0, le=U64)]   # the transfer buffer's registered address
    boot_id: Id                       # the prefill process that reported them

    def row_addresses(self, m: Manifest, pages=None) -> list[int]:
        """Addresses in prefill's registered buffer of the given pages' rows (default: all)."""
        idx = range(m.page_count) if pages is None else pages
        return [self.base + m.slots[i] * m.slot_bytes for i in idx]


class Handoff(WireModel):
    """What decode admits a transferred request by: prefill's manifest and the router's source."""
    manifest: Manifest
    source: TransferSource
    # the router's id of the request's first choice (of n): decode's queue reserves a client
    # request's choices one after another, by when its first arrived, not interleaved with
    # other requests' (pd/decode.py); a node from before it refuses the field (NodeInfo.choice_groups)
    choice_of: Id | None = None


# -- router -> node requests -----------------------------------------------------------------
class ScopeStamp(WireModel):
    """The generation of the tenant's cache scope a router sent a request under
    (kvfence/pd/scope_epochs.py): a node refuses a stamp older than one it retired, and
    retires the scope first for a newer one."""
    router: ScopePart   # the router process (a uuid's hex); a restarted router is another
    epoch: Count   # the router's tenants-file reload that last retired the name; 0: none


class PrefillBody(WireModel):
    """POST /internal/prefill: admit, compute all but the last prompt token, hold the KV."""
    request_id: Id
    tenant: ScopePart
    prompt_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
    params: WireParams
    public_prefix_scope: ScopePart | None = None
    # the node process the router checked (I8); another boot refuses with not_ready, so a
    # restarted node serves only once the router has checked it again
    expect_boot: Id | None = None
    # taken when the router checked the request's key; None: not sent by a router (tests)
    scope: ScopeStamp | None = None


class DecodeBody(PrefillBody):
    """POST /internal/decode: admit, pull by the handoff (none for a one-token prompt), decode."""
    handoff: Handoff | None = None


class ReleaseBody(WireModel):
    """POST /internal/release: decode verified the transfer (the ACK)."""
    request_id: Id


class AbortBody(WireModel):
    """POST /internal/abort: end a request; reader_stopped says no pull of it can be running."""
    request_id: Id
    reader_stopped: bool = False
    reason: Text = "aborted by the router"


class StopPullBody(WireModel):
    """POST /internal/stop_pull (decode): the router gave up on the request; end it, and say
    whether a read of prefill's rows for it can still be running."""
    request_id: Id


class StopPullReply(WireModel):
    reader_stopped: bool   # True: no read of it began, or every read that began has ended


class ForgetTenantsBody(WireModel):
    """POST /internal/forget_tenants (both roles): the router's tenants file retired these names
    (removed, or every key replaced); retire their cache scopes (prefix pages, compiled
    grammars), so that a tenant given one of the names later cannot attach or time them. A node
    retires only names whose epoch is new to it (a request stamped with it may have come first)."""
    tenants: Annotated[list[ScopePart], Field(min_length=1, max_length=MAX_TENANTS)]
    # the router and its reload that retired them; absent (a router from before scope stamps):
    # retire them whatever the node knows
    router: ScopePart | None = None
    epoch: Annotated[int, Field(ge=1, le=MAX_TOKEN_ID)] | None = None

    def model_post_init(self, _context: Any) -> None:
        if (self.router is None) != (self.epoch is None):
            raise ValueError("router and epoch come together, or neither")


class ForgetTenantsReply(WireModel):
    pages: Count   # prefix pages retired


class ControlReply(WireModel):
    result: Literal["released", "aborted", "unknown", "draining", "already_draining"]


# -- node -> router NDJSON events --------------------------------------------------------------
class WaitEvent(WireModel):
    """A heartbeat: the node is alive but has nothing new."""
    event: Literal["wait"] = "wait"


class AdmittedEvent(WireModel):
    event: Literal["admitted"] = "admitted"
    prompt_tokens: Count
    max_tokens: Count


class RejectedEvent(WireModel):
    """Refused at admission. A context_length_exceeded refusal carries its numbers as fields."""
    event: Literal["rejected"] = "rejected"
    code: Name
    message: Text
    limit: Count | None = None
    prompt_tokens: Count | None = None
    max_tokens: Count | None = None


class LogprobEntry(WireModel):
    token_id: TokenId
    logprob: float
    top: Annotated[list[tuple[TokenId, float]], Field(max_length=20)] = []


class ProgressEvent(WireModel):
    """One engine iteration's output for the request (tokens, or a PD milestone)."""
    event: Literal["tokens", "finished", "kv_held", "kv_verified", "kv_failed"]
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)] = []
    text: Annotated[str, Field(max_length=1 << 24)] = ""
    finished: bool = False
    finish_reason: Name | None = None
    error: Text | None = None
    abort_code: Name | None = None
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_tokens: Count = 0
    logprobs: Annotated[list[LogprobEntry], Field(max_length=MAX_PROMPT_IDS)] = []
    manifest: Manifest | None = None          # kv_held
    verified_tokens: Count | None = None      # kv_verified
    reader_stopped: bool | None = None        # kv_failed: decode is known not to be pulling
    # kv_held: seconds since the request's first engine step on this node, so the router can
    # place that step on its own clock (kvfence_queue_wait_seconds); a duration, as the two
    # machines' clocks do not compare. None from a node from before the field
    started_ago_s: Annotated[float, Field(ge=0, le=86400)] | None = None


class FailedEvent(WireModel):
    """The node's engine failed under the request."""
    event: Literal["failed"] = "failed"
    finished: bool = True
    error: Text
    abort_code: Name = "engine_failed"


NodeEvent = Annotated[WaitEvent | AdmittedEvent | RejectedEvent | ProgressEvent | FailedEvent,
                      Field(discriminator="event")]
_EVENTS: TypeAdapter[Any] = TypeAdapter(NodeEvent)


def parse_event(raw: str | bytes) -> WaitEvent | AdmittedEvent | RejectedEvent | ProgressEvent | FailedEvent:
    """One NDJSON line from a node, checked against the event definitions."""
    try:
        return _EVENTS.validate_json(raw, strict=True)
    except ValidationError as e:
        raise MessageError(f"malformed node event: {_explain(e)}") from None


def event_line(ev: WireModel) -> bytes:
    return ev.dumps() + b"\n"


# -- GET /internal/info ----------------------------------------------------------------------
class PdFacts(WireModel):
    """What a PD node's KV link says about itself (KvLink.facts)."""
    role: Literal["prefill", "decode"]
    boot_id: Id
    transfer_session: Name
    buffer_base: Annotated[int, Field(ge=0, le=U64)]
    kv_layout: Name
    slot_bytes: Annotated[int, Field(ge=1)]
    buffer_rows: Annotated[int, Field(ge=0)]
    lease_s: Annotated[float, Field(gt=0)]
    max_pull_s: Annotated[float, Field(gt=0)]
    clock_skew_s: Annotated[float, Field(ge=0)]


class PdSecurity(WireModel):
    """How a PD process's internal HTTP is protected (kvfence/pd/tls.py TlsSettings.describe)."""
    tls: bool
    client_certificates_required: bool
    plaintext_network_allowed: bool


# the snapshot counts the router sums over its nodes and routes by (pd/router.py, pd/fleet.py)
SNAPSHOT_COUNTS = ("running", "waiting", "pages_total", "pages_free", "pages_owned", "pages_shared",
                   "pages_quarantined", "capacity_tokens", "preemptions", "prefix_cache_hit_tokens",
                   "tokens_computed")


class NodeInfo(WireModel):
    """A node's static facts (server/engine_loop.engine_facts), its PD facts, and the live
    snapshot of its engine (counts only; read by the router, benches and the canary)."""
    model_name: Name
    model_path: Text
    default_served_name: Name
    fingerprint: Name
    dtype: Name
    # bf16 (dequantized), native or mixed (LlamaModel.weights_mode); a node from before the field
    # existed ran dequantized weights, so its absence means bf16 (a rolling upgrade keeps serving)
    weights: Name = "bf16"
    # what runs the model (LLMEngine.compute_path, matmul_path, kernels_state), for the node's own
    # metrics and an operator reading its info; None from a node from before the fields
    compute: Text | None = None
    matmul: Text | None = None
    kernels: Name | None = None
    device: Name
    page_size: Annotated[int, Field(ge=1)]
    pool_pages: Count
    pool_tokens: Count
    pool_bytes: Annotated[int, Field(ge=0)]
    model_max_context: Count
    configured_max_model_len: Count | None
    usable_context: Count
    context_clamped: bool
    context_note: Text
    scrub: Name
    read_checks: bool
    max_num_seqs: Annotated[int, Field(ge=1)]
    max_num_batched_tokens: Annotated[int, Field(ge=1)]
    vocab_size: Annotated[int, Field(ge=1)]
    prefix_cache: bool
    pd: PdFacts
    # EngineConfig.tenant_waiting_places; None from a node from before the field (the router
    # then refuses no n up front: the node's 503 answers it, as before)
    tenant_waiting_places: Annotated[int, Field(ge=1)] | None = None
    pd_security: PdSecurity | None = None
    # checks ScopeStamp (pd/scope_epochs.py); a node from before it refuses the stamp as an
    # unknown field, so the router sends it none (the router is upgraded first)
    scope_stamps: bool = False
    # reads Manifest.seal_key (pd/seal.py key ids); a node from before them refuses the field,
    # so the router leaves it out of that node's handoffs
    seal_keys: bool = False
    # reads Handoff.choice_of; the router leaves it out for a node from before it
    choice_groups: bool = False
    # the key ids (pd/seal.py) of the secret the node seals and would send with, then of those it
    # accepts: what a rotation step has reached on this node (ids name secrets, never reveal them)
    secret_key_ids: Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]], Field(max_length=16)] = []
    snapshot: dict[str, Any] = {}

    @field_validator("snapshot")
    @classmethod
    def _counts_are_counts(cls, v: dict[str, Any]) -> dict[str, Any]:
        """The snapshot is the engine's free-form stats, but what the router adds up and routes
        by must be what it says: a null or a string there stopped the router's monitor."""
        for k in SNAPSHOT_COUNTS:
            if k in v and not (type(v[k]) is int and 0 <= v[k] <= U64):
                raise ValueError(f"snapshot.{k} must be a count, got {v[k]!r}"[:200])
        viol = v.get("violations", {})
        if not (isinstance(viol, dict) and all(type(c) is int and c >= 0 for c in viol.values())):
            raise ValueError("snapshot.violations must map invariants to counts")
        if not isinstance(v.get("draining", False), bool):
            raise ValueError("snapshot.draining must be a boolean")
        return v

    def source(self) -> TransferSource:
        """Where a decode node pulls this (prefill) node's holds from."""
        return TransferSource(session=self.pd.transfer_session, base=self.pd.buffer_base, boot_id=self.pd.boot_id)

    def facts(self) -> dict[str, Any]:
        """The static facts as the server's dict (without the snapshot)."""
        d = self.to_json()
        d.pop("snapshot")
        return d

