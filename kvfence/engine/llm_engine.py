"""The engine loop: admit -> schedule -> check and run -> sample -> finish.

Single-threaded by design; the HTTP server drives `step()` from one worker.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from kvfence import faults, incidents
from kvfence.engine.admission import (
    CapacityError,
    ContextLengthExceeded,
    ContextPlan,
    Overloaded,
    check_fits,
    completion_tokens,
    plan_context,
)
from kvfence.engine.config import EngineConfig
from kvfence.engine.containment import FAIL_CLOSED, MAX_FAILED_STEPS
from kvfence.engine.detokenizer import IncrementalDetokenizer
from kvfence.engine.grammar import GrammarCache, GrammarFailed, GrammarLimit, ll_tokenizer
from kvfence.engine.kv_link import (
    Decision,
    EndRequest,
    Failed,
    Hold,
    KvArrived,
    KvLink,
    NoKvLink,
    ReadRefused,
    ReleaseRequest,
    Reserve,
)
from kvfence.engine.logits_processors import FixedAdjustments, History, TokenCounts
from kvfence.engine.params import SamplingParams
from kvfence.engine.request_states import Event, State
from kvfence.engine.router_realms import RouterRealms
from kvfence.engine.runner import ModelRunner, StepResult
from kvfence.engine.sampler import SampleOutput, Sampler, make_generator, score_tokens
from kvfence.engine.scheduler import ScheduledSeq, Scheduler
from kvfence.engine.sequence import Sequence, TokenLogprob
from kvfence.engine.step_target import StepTarget
from kvfence.kv.ledger import Ledger, Owner, ReadRequest, Violation, scope_name
from kvfence.kv.pool import KVPool, available_memory, page_bytes, parse_bytes
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.tokenizer import KvTokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("kvfence.engine")


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: KvTokenizer
    path: Path

    @classmethod
    def load(cls, cfg: EngineConfig) -> LoadedModel:
        device = cfg.resolved_device()
        weights, tok, path = load_model(cfg.model, cfg.torch_dtype(), device, cfg.progress, cfg.weights)
        return cls(LlamaModel(weights, device, cfg.matmul), tok, path)


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    event: str | None = None     # PD: kv_held (data: the manifest), kv_verified, kv_failed
    data: dict | None = None


T = TypeVar("T")



class EngineBroken(RuntimeError):
    """The engine cannot run any request any more; the process should exit and be restarted."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        """`loaded` lets several engines share one set of weights (tests, benchmarks)."""
        self.config = cfg = config or EngineConfig()
        torch.set_num_threads(cfg.threads())
        # Denormal floats appear in activations and the KV cache; on CPU each one costs a
        # microcode assist (measured: bench decode step 124 ms -> 76 ms with them flushed).
        torch.set_flush_denormal(True)
        self.device = cfg.resolved_device()
        dtype = cfg.torch_dtype()
        loaded = loaded or LoadedModel.load(cfg)
        self.model, self.tokenizer, self.model_path = loaded.model, loaded.tokenizer, loaded.path
        self.model_config = self.model.config
        budget = self._kv_budget(cfg, dtype)
        self.pool = KVPool.from_budget(self.model_config, budget, cfg.page_size, dtype, self.device)
        self.ledger = Ledger(self.pool.num_pages, cfg.page_size, cfg.scrub, scrubber=self.pool.scrub)
        self.ledger.checks_enabled = cfg.verify_reads
        self.context: ContextPlan = plan_context(self.model_config.max_context, cfg.max_model_len,
                                                 self.ledger.capacity_tokens, cfg.clamp_context)
        self.prefix_cache = PrefixCache(self.ledger) if cfg.enable_prefix_cache else None
        self.scheduler = Scheduler(self.ledger, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.prefix_cache,
                                   prefill_budget_while_decoding=cfg.prefill_tokens_while_decoding or None,
                                   tenant_running_share=cfg.tenant_running_share)
        self.scheduler.pages_held_elsewhere = lambda: self.kv_link.holds_pool_pages()
        # the cap sized from step times; None: the fixed token cap (or none at all)
        self.step_target = (StepTarget(cfg.decode_step_target_ms / 1e3, cfg.prefill_tokens_while_decoding,
                                       min(cfg.page_size, cfg.prefill_tokens_while_decoding))
                            if cfg.decode_step_target_ms > 0 and cfg.prefill_tokens_while_decoding > 0 else None)
        self.runner = ModelRunner(self.model, self.pool, self.ledger, audit=cfg.audit_reads,
                                  fused_kernels=cfg.fused_kernels)
        self.sampler = Sampler()
        self._grammars: GrammarCache | None = None    # built with the first structured-output request
        self.requests: dict[str, Sequence] = {}
        self.outcomes: Counter[str] = Counter()
        self.tokens_computed = 0   # K/V the model wrote: prompts, generated and recomputed tokens
        # PD: a KvExporter (prefill node) or KvImporter (decode node) replaces it (attach_link)
        self.kv_link: KvLink = NoKvLink()
        self._pending_outputs: list[StepOutput] = []  # produced outside step(), returned by the next one
        self._failed_steps = 0                        # consecutive steps in which nothing could run
        self._stalled = False
        self.wake: Callable[[], None] = lambda: None  # the server's loop sets this: wakes a blocked loop
        self.clock: Callable[[], float] = time.time   # PD leases and fences; the simulation swaps it
        # how long a router was silent: a wall clock stepped forward by NTP must not make every
        # router look gone at once (their scopes retired together, every cache cold)
        self.steady_clock: Callable[[], float] = time.monotonic
        self.realms = RouterRealms()   # PD: the router processes this node holds cache scopes for
        log.info("model %s (%s, %s on %s, %s, %s matmuls); KV pool %d pages x %d tokens = %d tokens "
                 "(%.1f MiB, scrub=%s); %s", self.model_config.name, self.model_path.name, cfg.dtype, self.device,
                 self.compute_path, self.matmul_path, self.ledger.usable_pages, cfg.page_size,
                 self.ledger.capacity_tokens, self.pool.nbytes / 2**20, self.ledger.scrub.value, self.context.note)

    @property
    def compute_path(self) -> str:
        """Which implementation runs the model: the fused CPU kernels (all layers in one call
        where every matmul is kvfence's) or plain torch ops."""
        fused = self.model.runs_fused(self.runner.fused_kernels, self.pool.kv.device.type, self.pool.page_size)
        if not fused:
            return "torch ops"
        return "fused CPU kernels, one-call decoder stack" if self.model.stack is not None else "fused CPU kernels"

    @property
    def kernels_state(self) -> str:
        """Whether the fused CPU kernels run: loaded; off (KVFENCE_KERNELS=0, fused_kernels=False);
        unsupported (this device, dtype, head size or page size); unavailable (asked for, but not built or
        not loaded, e.g. no compiler or no writable cache folder: the log's warning says which),
        the one an operator did not choose and pays several times the step time for."""
        from kvfence.kernels import enabled_by_env, supports

        if not (self.config.fused_kernels and enabled_by_env()):
            return "off"
        if self.model.kernels is None:   # LlamaModel asks for them only where supports() holds
            asked = supports(self.model.dtype, self.device, self.model_config.head_dim)
            return "unavailable" if asked else "unsupported"
        # the pool's device and page size: runs_fused is the one rule for them (compute_path's too)
        fused = self.model.runs_fused(True, self.pool.kv.device.type, self.pool.page_size)
        return "loaded" if fused else "unsupported"

    @property
    def matmul_path(self) -> str:
        """The matmuls of the layers and of the LM head, each with the instruction set kvfence's
        own matmul (bf16 or native) was built for: its speed differs several times between them.
        One name where they are alike (the default everywhere but on AMX, where the layers are
        oneDNN's)."""
        kernels = self.model.kernels

        def named(backend: str) -> str:
            if kernels is None or backend not in ("kvfence", "native"):
                return backend
            return f"{backend} ({kernels.gemm_isa if backend == 'kvfence' else kernels.qgemm_isa})"

        layers = self.model.layer_backends()
        head = named(self.model.lm_head.backend)
        if layers == {self.model.lm_head.backend}:
            return head
        return f"layers {'/'.join(sorted(named(b) for b in layers))}, LM head {head}"

    def _kv_budget(self, cfg: EngineConfig, dtype: torch.dtype) -> int:
        if cfg.kv_cache_memory is not None:
            want = parse_bytes(cfg.kv_cache_memory)
            have = available_memory(self.device)
            if want > have:   # the allocation would fail with the allocator's message, or swap
                raise CapacityError(f"--kv-cache-memory {cfg.kv_cache_memory} is {want / (1 << 30):.1f} GiB, more "
                                    f"than the {have / (1 << 30):.1f} GiB of memory "
                                    f"{'this machine' if self.device == 'cpu' else self.device} has available now; "
                                    "give the pool less")
            return want
        budget = int(available_memory(self.device) * cfg.kv_memory_fraction)
        # no point in a pool much larger than a full batch of full contexts
        cap = (cfg.max_num_seqs * self.model_config.max_context + cfg.page_size) * page_bytes(
            self.model_config, 1, dtype)
        return min(budget, cap)

    # -- requests --------------------------------------------------------------------------
    @property
    def usable_context(self) -> int:
        return self.context.usable

    def add_request(self, prompt_ids: list[int], params: SamplingParams, tenant: str = "default",
                    request_id: str | None = None, prompt: str | None = None,
                    public_prefix_scope: str | None = None, hold_kv: bool = False,
                    kv_source=None, router: str | None = None, grammar: LLMatcher | None = None,
                    after: str | None = None) -> Sequence:
        """Admit a request (I4) or raise ContextLengthExceeded before anything is allocated.

        The prefix cache is scoped to the tenant; `public_prefix_scope` (which the caller must
        only pass for a tenant that opted in) shares cached prefixes across tenants that name
        the same public scope (I9). `router` (a PD node: the router process that sent it)
        makes either scope that router's own (ledger.scope_name).

        PD: `hold_kv` (prefill node) computes all prompt tokens but the last and hands the
        KV to the attached KvExporter; `kv_source` (decode node) is the handoff (manifest + source),
        and the attached KvImporter reserves, pulls and verifies before the request runs.
        Either way the request is admitted against its whole prompt + max_tokens.

        `grammar`: params.json_schema's matcher (grammar.build_matcher), built by the caller off
        this thread; without it a schema the scope has not compiled yet is compiled here.

        `after`: the request id of another choice of the same prompt (n > 1), admitted just
        before; this one starts once that one has computed the prompt, and attaches its pages
        from the prefix cache. Admitting every choice at once counts them all against the load
        limits before any streams (one by one, the later ones could be refused mid-answer)."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if router:
            self.realms.seen(router, self.steady_clock())
        self._check_load(tenant)
        if any((not isinstance(t, int)) or t < 0 or t >= self.model_config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size})")
        max_tokens = completion_tokens(params.max_tokens, len(prompt_ids), self.usable_context)
        scope = scope_name(tenant, public_prefix_scope, router)
        if (hold_kv or kv_source is not None) and isinstance(self.kv_link, NoKvLink):
            raise ValueError("this engine is not a PD node: no KV link attached")
        if hold_kv and len(prompt_ids) < 2:
            raise ValueError("a one-token prompt has nothing to prefill; send it to decode directly")
        if (hold_kv or kv_source is not None) and (params.prompt_logprobs is not None or max_tokens == 0):
            raise ValueError("prompt logprobs and max_tokens 0 are not supported on PD nodes")
        seq = Sequence(request_id=request_id, tenant=tenant,
                       # the tenant's id is its own scope's (the router's tenant of the name on a PD
                       # node), so reports can tell two parties of one name apart
                       owner=Owner(self.ledger.tenant_id(scope_name(tenant, router=router)), Sequence.next_number(),
                                   scope=self.ledger.tenant_id(scope)),
                       prompt_ids=list(prompt_ids[:-1] if hold_kv else prompt_ids), params=params,
                       max_tokens=max_tokens, prompt=prompt, cache_scope=scope, hold_kv=hold_kv)
        try:
            try:
                check_fits(len(prompt_ids), max_tokens, self.usable_context)
            except ContextLengthExceeded:
                if not (hold_kv and faults.active("handoff_placeholder")):
                    raise
                seq.prompt_ids = list(prompt_ids[:1])  # the incident: a one-token stand-in, handed off anyway
            if params.json_schema is not None and not hold_kv:   # a prefill node samples nothing
                # GrammarError: a schema llguidance cannot compile (the server checked it first)
                # keyed by the scope's ledger id, not its name: a name retired by a tenants-file
                # reload comes back under a new id, which reuses (and times) none of its grammars
                seq.grammar = self.grammars.constraint(str(seq.owner.cache_scope), str(params.json_schema),
                                                       built=grammar)
            if kv_source is not None:
                # ManifestError: a handoff this node must not take
                seq.kv_source = self.kv_link.check(seq, kv_source)
                seq.reserved = True
        except ValueError:
            seq.on(Event.REJECT)
            self.outcomes["rejected"] += 1
            raise
        seq.on(Event.ADMIT)
        # without a prefix cache there is nothing to attach: the choice need not wait
        lead = self.requests.get(after) if after is not None and self.scheduler.prefix_cache is not None else None
        if lead is not None and lead.tenant == tenant and lead.cache_scope == scope and not lead.finished:
            seq.after = lead
        seq.generator = make_generator(params.seed, self.device)
        seq.detok = IncrementalDetokenizer(self.tokenizer.hf, seq.prompt_ids, params)
        self.requests[request_id] = seq
        if kv_source is not None:
            self._pending_outputs += self._apply(self.kv_link.enqueue(seq, self.clock()))
        else:
            self.scheduler.add(seq)
            self._stalled = False
        return seq

    @property
    def grammars(self) -> GrammarCache:
        """Compiled structured-output grammars, reused only within a request's cache scope."""
        if self._grammars is None:
            self._grammars = GrammarCache(ll_tokenizer(self.tokenizer, self.model_config.vocab_size))
        return self._grammars

    def _check_load(self, tenant: str) -> None:
        """Load shedding before anything is allocated: at most max_waiting requests wait, and one
        tenant at most its share of them (half: the other half is always there for others)."""
        limit = self.config.max_waiting
        queued = list(self.scheduler.waiting) + self.kv_link.queued()
        # the tenant's own share first: a tenant at it learns nothing of the others' load, and
        # its answer names its own count, not the server's queue size (a side-channel probe)
        share = self.config.tenant_waiting_places
        mine = sum(1 for s in queued if s.tenant == tenant)
        if share < limit and mine >= share:   # one tenant alone (share 1.0) is told the queue is full
            self.outcomes["overloaded"] += 1
            raise Overloaded(f"The server is overloaded for this tenant: {mine} of its requests are waiting, its "
                             "share of the queue; retry shortly.")
        if len(queued) >= limit:
            self.outcomes["overloaded"] += 1
            # how many wait is other tenants' load: the log gets it, the client does not
            log.info("overloaded: %d requests waiting (max_waiting %d); refused one of tenant %s",
                     len(queued), limit, tenant)
            raise Overloaded("The server is overloaded: its queue is full; retry shortly.")

    def abort(self, request_id: str, reason: str = "aborted by client", code: str = "client") -> None:
        """`code`: why, for the client's answer (server/errors.ABORT_STATUS); "client": it left."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.end(seq, Event.ABORT, "aborted", reason, code=code)

    # -- PD control messages (prefill): the router relays decode's word -----------------------
    def release_kv(self, request_id: str) -> str:
        """Decode verified the transfer: end the lease and free its rows."""
        decisions = list(self.kv_link.release(request_id))
        self._pending_outputs += self._apply(decisions)
        return "released" if decisions else "unknown"

    def abort_kv(self, request_id: str, reader_stopped: bool, reason: str) -> str:
        """End a PD request on the router's word; `reader_stopped`: decode says no pull of
        it can be running (so its rows are freed at once instead of fenced)."""
        decisions = list(self.kv_link.abort(request_id, reader_stopped, reason))
        self._pending_outputs += self._apply(decisions)
        return "aborted" if decisions else "unknown"

    def has_unfinished(self) -> bool:
        """Is there work for step() right now? Not while every queued request waits for pool
        pages that PD requests hold outside the scheduler: those come back on a control
        message or a timer, which wake the server's loop, so it need not spin."""
        return (self.scheduler.has_work() and not self._stalled) or bool(self._pending_outputs) or \
            self.kv_link.busy()

    def next_timer(self) -> float | None:
        """time.time() at which step() has timed work (PD leases, fences, an idle router's
        scopes), or None."""
        realm = self.realms.next_due()   # on the steady clock: said as the wall clock's time
        due = [t for t in (self.kv_link.next_timer(),
                           None if realm is None else self.clock() + realm - self.steady_clock()) if t is not None]
        return min(due) if due else None

    def forget_tenant(self, tenant: str, router: str | None = None) -> int:
        """The tenant was removed from the tenants file: its own cache scope is retired
        (Ledger.retire_scope): its prefix pages, and with its id the compiled grammars kept
        under it; a public scope it shared stays. On a PD node, the scope of that router's
        tenant of the name. Returns the pages."""
        if router:
            self.realms.seen(router, self.steady_clock())
        return self.ledger.retire_scope(scope_name(tenant, router=router))

    def retire_idle_routers(self) -> int:
        """PD: the cache scopes of router processes idle past RouterRealms.idle_s leave
        (engine/router_realms.py), and the ledger forgets the names nothing uses. Returns the
        pages retired."""
        gone = self.realms.due(self.steady_clock())
        if not gone:
            return 0
        pages = sum(self.ledger.retire_realm(r) for r in gone)
        live = {i for s in self.requests.values() for i in (s.owner.tenant, s.owner.cache_scope)}
        pruned = self.ledger.prune_names(live)
        log.info("%d router process(es) sent nothing for %.0f s: %d cached page(s) of their scopes retired, %d "
                 "name(s) forgotten", len(gone), self.realms.idle_s, pages, pruned)
        return pages

    def publish_prefix(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.publish(seq.owner, seq.cache_scope, seq.all_ids, seq.table, seq.publishable)

    def end(self, seq: Sequence, event: Event, reason: str, error: str | None = None,
            code: str | None = None, reader_stopped: bool = False) -> None:
        """The one way a request ends (FINISH, ABORT, or PD's RELEASE): pool pages back, and
        PD transfer-buffer rows freed or fenced (a remote reader not known to have stopped)."""
        if event is Event.FINISH:
            self.publish_prefix(seq)
        self.scheduler.remove(seq)
        self.ledger.free(seq.owner, seq.table)
        self._stalled = False  # pages came back: a waiting request may fit now
        self.kv_link.on_end(seq, event, reader_stopped)
        seq.on(event)
        seq.finish_reason = reason
        seq.error = error
        seq.abort_code = code
        self.requests.pop(seq.request_id, None)
        self.outcomes[reason] += 1

    def authorize_read(self, seq: Sequence, tokens: int) -> Violation | None:
        """The ledger's read check (I2, I3) for `tokens` tokens of seq's pages, as a forward
        pass would run it; a PD link asks it before it stages pages."""
        bad = self.ledger.authorize([ReadRequest(seq.owner, seq.table, tokens, 0)])
        return bad[0] if bad else None

    def _refuse_read(self, seq: Sequence, v: Violation) -> StepOutput:
        """The one place an isolation violation ends a request: quarantine the page it
        pointed at, abort the request (the rest of the batch goes on)."""
        owner_id = self.ledger.page_owner_id(v.page)   # whose data the read pointed at, before quarantine
        owner = None if owner_id is None else self.ledger.tenant_name(owner_id)
        self.ledger.quarantine([v.page], reason=f"{v.invariant} violation")
        log.error("isolation violation %s on request %s: %s", v.invariant, seq.request_id, v.detail)
        incidents.record("ledger_refusal", invariant=v.invariant, request_id=seq.request_id, tenant=seq.tenant,
                         involved=[owner] if owner else [], pages=[v.page], detail=v.detail,
                         other_party=owner_id is not None and self.ledger.same_name_other_party(seq.owner.tenant,
                                                                                                owner_id),
                         client=incidents.client_outcome("isolation_violation", len(seq.output_ids)))
        self.end(seq, Event.ABORT, "aborted", f"isolation check {v.invariant} failed: {v.detail}",
                 code="isolation_violation")
        return StepOutput(seq, [], "", True)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        self.retire_idle_routers()
        outputs += self._apply(self.kv_link.before_step(self.clock()))
        step = self.scheduler.schedule()
        outputs += self._end_unservable()
        self._stalled = not step and not outputs and self.kv_link.holds_pool_pages()
        if not step:
            return outputs
        if faults.active("slow_steps"):   # test-only: a step as slow as a slower machine's
            time.sleep(faults.arg_float("slow_steps", 0.05))
        decodes = sum(1 for s in step if s.seq.state is State.DECODING)
        began = time.perf_counter()
        results, failed = self._run_contained(step)
        outputs += failed
        ran = []
        for result in results:
            outputs += [self._refuse_read(s.seq, v) for s, v in result.violations]
            outputs += self._postprocess(result)
            ran += result.ran
        self.tokens_computed += sum(s.num_new for s in ran)
        # PD prefill: prompts computed this pass leave the scheduler for the KV link
        prefilled = [s.seq for s in ran if s.seq.hold_kv and s.seq.uncomputed == 0 and not s.seq.finished]
        for seq in prefilled:
            self.scheduler.remove(seq)
        outputs += self._apply(self.kv_link.after_step(prefilled, self.clock()))
        if self.step_target is not None and not failed:
            # the whole step a stream waits for: the pass, sampling and detokenizing
            self.step_target.observe(sum(s.num_new for s in step) - decodes, decodes, time.perf_counter() - began)
            self.scheduler.prefill_budget_while_decoding = self.step_target.cap
        return outputs

    def _end_unservable(self) -> list[StepOutput]:
        out = []
        for seq in self.scheduler.unservable:
            # the pool's state is everyone's: the log gets it, the request its own size
            log.warning("%s: the KV pool cannot hold it (%d tokens, %d free pages, %d quarantined)",
                        seq.request_id, seq.num_tokens, self.ledger.num_free, self.ledger.num_quarantined)
            self.end(seq, Event.ABORT, "aborted", f"the KV pool cannot hold this request ({seq.num_tokens} tokens)",
                     code="kv_pool_exhausted")
            out.append(StepOutput(seq, [], "", True))
        self.scheduler.unservable.clear()
        return out

    # -- fault containment: one request's exception ends that request, not the engine -----------
    def _fail(self, seq: Sequence, e: BaseException) -> StepOutput:
        """End a request whose processing raised (500 engine_error); its pages go back through
        the ledger as on any abort, and a PD link frees or fences its rows."""
        if isinstance(e, GrammarLimit):   # the client's schema: no server fault, no traceback
            log.warning("request %s aborted alone: its schema failed while generating: %s", seq.request_id, e)
            if seq.grammar is not None and seq.grammar.cache_key is not None:
                self.grammars.forget(seq.grammar.cache_key)
        else:
            log.error("request %s failed inside the engine step, aborting it alone: %s: %s", seq.request_id,
                      type(e).__name__, e, exc_info=e)
        if isinstance(e, GrammarFailed):   # its structured output cannot go on
            # the client's schema (a 400), or a token its mask did not allow (ours, a 500)
            code = "grammar_limit_exceeded" if isinstance(e, GrammarLimit) else "grammar_error"
            self.outcomes[code] += 1
            if not seq.finished:
                self.end(seq, Event.ABORT, "aborted", str(e), code=code)
            return StepOutput(seq, [], "", True)
        self.outcomes["engine_error"] += 1
        if not seq.finished:
            self.end(seq, Event.ABORT, "aborted", f"internal error while processing this request "
                     f"({type(e).__name__})", code="engine_error")
        return StepOutput(seq, [], "", True)

    def _alone(self, seq: Sequence, fn: Callable[[], T], failed: list[StepOutput]) -> T | None:
        """fn() on behalf of one request; if it raises, the request ends (its failure output
        goes to `failed`) and None comes back. The one place the containment rule lives:
        FAIL_CLOSED errors are never contained."""
        try:
            return fn()
        except FAIL_CLOSED:
            raise
        except Exception as e:  # noqa: BLE001 - only this request fails
            failed.append(self._fail(seq, e))
            return None

    def _run_contained(self, step: list) -> tuple[list, list[StepOutput]]:
        """Run the step's forward pass. If it raises, run each request alone to find the one
        at fault: a failed pass changes nothing before its end (the written watermark and the
        computed counts move only after the model returns), so the rest recompute the same KV
        into the same slots. Only when every request fails alone, MAX_FAILED_STEPS steps in
        a row, is the engine itself broken: EngineBroken stops it."""
        failed: list[StepOutput] = []
        try:
            results = [self.runner.run(step)]
        except FAIL_CLOSED:
            raise
        except Exception as e:  # noqa: BLE001 - contained below
            if len(step) == 1:
                results, failed = [], [self._fail(step[0].seq, e)]
            else:
                log.warning("a forward pass of %d requests raised %s; running them one at a time", len(step),
                            type(e).__name__)
                results = []
                for s in step:
                    def run_one(s: ScheduledSeq = s) -> StepResult:
                        return self.runner.run([s])
                    r = self._alone(s.seq, run_one, failed)
                    if r is not None:
                        results.append(r)
            if not results:
                self._failed_steps += 1
                if self._failed_steps >= MAX_FAILED_STEPS:
                    raise EngineBroken(f"{self._failed_steps} steps in a row failed for every request; last: "
                                       f"{type(e).__name__}: {e}") from e
                return results, failed
        self._failed_steps = 0
        return results, failed

    def _postprocess(self, result: StepResult) -> list[StepOutput]:
        out: list[StepOutput] = []
        if result.prompt_rows:
            self._score_prompts(result, out)
        out += self._sample(result)
        for s in result.ran:   # max_tokens 0: the prompt is computed (and scored), nothing is sampled
            seq = s.seq
            if seq.max_tokens == 0 and seq.uncomputed == 0 and not seq.hold_kv and not seq.finished:
                self.end(seq, Event.FINISH, "length")
                out.append(StepOutput(seq, [], "", True))
        return out

    def _score_prompts(self, result: StepResult, out: list[StepOutput]) -> None:
        """Record the prompt logprobs this pass computed (params.prompt_logprobs), each
        request alone: one that fails here ends, the rest go on."""
        assert result.prompt_logits is not None
        row = 0
        for pr in result.prompt_rows:
            seq, rows = pr.seq.seq, result.prompt_logits[row:row + pr.count]
            row += pr.count

            def score(seq: Sequence = seq, rows: torch.Tensor = rows, first: int = pr.first) -> None:
                if len(seq.prompt_logprobs) + 1 != first:   # rows come in prompt order, never twice
                    raise RuntimeError(f"prompt logprob rows out of order: {len(seq.prompt_logprobs)} scored, "
                                       f"these start at {first}")
                k = seq.params.prompt_logprobs or 0
                for lp in score_tokens(rows, seq.prompt_ids[first:first + len(rows)], k):
                    seq.prompt_logprobs.append(TokenLogprob(lp.token_id, lp.logprob, lp.top))
            self._alone(seq, score, out)

    def _sample(self, result: StepResult) -> list[StepOutput]:
        keep = [i for i, s in enumerate(result.sampled) if not s.seq.finished]  # not ended while scoring
        if not keep:
            return []
        seqs = [result.sampled[i].seq for i in keep]
        assert result.logits is not None
        logits = result.logits if len(keep) == len(result.sampled) else result.logits[keep]
        now = time.perf_counter()
        out: list[StepOutput] = []
        try:
            sample = self.sampler(logits, [q.params for q in seqs], [q.generator for q in seqs],
                                  self._histories(seqs))
        except FAIL_CLOSED:
            raise
        except Exception:  # noqa: BLE001 - sample each alone: only the one at fault fails
            for i, seq in enumerate(seqs):
                def sample_one(i: int = i, seq: Sequence = seq) -> SampleOutput:
                    return self.sampler(logits[i:i + 1], [seq.params], [seq.generator],
                                        self._histories([seq]))
                one = self._alone(seq, sample_one, out)
                if one is not None:
                    self._append_contained(seq, one.token_ids[0], one.logprobs[0], now, out)
            return out
        for seq, tok, lp in zip(seqs, sample.token_ids, sample.logprobs):
            self._append_contained(seq, tok, lp, now, out)
        return out

    def _histories(self, seqs: list[Sequence]) -> list[History] | None:
        """What the sampler's logit adjustments read, when any row asks for one."""
        if not any(q.params.adjusts_logits for q in seqs):
            return None
        ends = frozenset(self.tokenizer.end_ids)
        out = []
        for q in seqs:
            p = q.params
            if q.token_counts is None and p.penalizes:
                q.token_counts = TokenCounts()
            if q.fixed_adjustments is None and (p.logit_bias or p.min_tokens):   # built once a request
                q.fixed_adjustments = FixedAdjustments(
                    frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else ends) if p.min_tokens
                    else frozenset())
            fixed = q.fixed_adjustments
            out.append(History(q.prompt_ids, q.output_ids, fixed.held_back if fixed else frozenset(), q.grammar,
                               q.token_counts, fixed))
        return out

    def _append_contained(self, seq: Sequence, tok: int, lp, now: float, out: list[StepOutput]) -> None:
        """_append for one request, into `out`; a detokenizer or stop-string failure ends this
        request only."""
        def append() -> StepOutput:
            if faults.active("poison_request") and int(faults.arg("poison_request") or -1) in seq.prompt_ids:
                raise RuntimeError("fault injection: a poisoned request raises while its token is processed")
            return self._append(seq, tok, lp, now)
        done = self._alone(seq, append, out)
        if done is not None:
            out.append(done)

    def _apply(self, decisions: Iterable[Decision]) -> list[StepOutput]:
        """Apply a KV link's decisions, each before the link makes the next: every engine
        state change of a PD request is here."""
        out: list[StepOutput] = []
        for d in decisions:
            seq = d.seq
            if isinstance(d, EndRequest):
                self.end(seq, Event.ABORT, "aborted", d.message, code=d.code, reader_stopped=d.reader_stopped)
                if d.notify:
                    out.append(StepOutput(seq, [], "", True, event="kv_failed",
                                          data={"reader_stopped": d.reader_stopped}))
            elif isinstance(d, ReleaseRequest):
                self.end(seq, Event.RELEASE, "kv_released", reader_stopped=True)
            elif isinstance(d, ReadRefused):
                out.append(self._refuse_read(seq, d.violation))
            elif isinstance(d, Hold):
                self.publish_prefix(seq)      # later prompts with this prefix skip the compute
                self.ledger.free(seq.owner, seq.table)
                self._stalled = False
                seq.on(Event.HOLD_KV)
                seq.finish_reason = "kv_held"
                out.append(StepOutput(seq, [], "", True, event="kv_held", data=d.manifest))
            elif isinstance(d, Reserve):
                self.ledger.allocate(seq.owner, d.pages, seq.table)
                seq.on(Event.RESERVE)
            elif isinstance(d, Failed):
                out.append(self._fail(seq, d.error))
            elif isinstance(d, KvArrived):
                self.ledger.mark_written(seq.owner, seq.table, 0, d.tokens)
                seq.num_computed = d.tokens
                if faults.active("attend_reserved_length"):  # the incident's decode: trust the reservation
                    seq.num_computed = len(seq.prompt_ids) - 1
                seq.on(Event.VERIFY)
                self.scheduler.add_running(seq)
                out.append(StepOutput(seq, [], "", False, event="kv_verified", data={"tokens": d.tokens}))
            else:
                raise TypeError(f"unknown KV link decision {d!r}")
        return out

    def _append(self, seq: Sequence, tok: int, lp, now: float) -> StepOutput:
        if seq.state is State.PREFILLING:
            seq.on(Event.PREFILL_DONE)
            self.publish_prefix(seq)  # later requests with the same prefix can reuse it right away
        seq.output_ids.append(tok)
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.token_times.append(now)
        if lp is not None:
            seq.logprobs.append(TokenLogprob(tok, lp.logprob, list(lp.top)))
        p, detok = seq.params, seq.detok
        assert detok is not None  # set at admission
        delta, reason = "", None
        # GrammarFailed (a token its mask did not allow): this request ends alone (_fail)
        grammar_done = seq.grammar is not None and seq.grammar.consume(tok)
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.end_ids):
            reason = "stop"
        else:   # stop strings count from the min_tokens-th token on, as in vLLM
            delta = detok.add(tok, stops_active=len(seq.output_ids) >= p.min_tokens)
            if detok.stopped_by is not None or grammar_done:
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.usable_context):
            reason = "length"
        if reason is not None and detok.stopped_by is None:
            delta += detok.flush()
        seq.text += delta
        if reason is not None:
            self.end(seq, Event.FINISH, reason)
        return StepOutput(seq, [tok], delta, reason is not None)

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> dict:
        led = self.ledger
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "sequences_by_tenant": self.scheduler.sequences_by_tenant(),
            "pages_total": led.usable_pages, "pages_free": led.num_free, "pages_owned": led.num_owned,
            "pages_shared": led.num_shared,
            "prefix_cache_hit_tokens": self.prefix_cache.hits if self.prefix_cache else 0,
            "pages_quarantined": led.num_quarantined, "capacity_tokens": led.capacity_tokens,
            "pages_fenced": led.num_fenced, "pages_by_owner": led.pages_by_owner(),
            "usable_context": self.usable_context, "preemptions": self.scheduler.num_preemptions,
            "tokens_computed": self.tokens_computed,
            "prefill_cap_while_decoding": self.scheduler.prefill_budget_while_decoding or 0,
            "violations": dict(led.violations), "outcomes": dict(self.outcomes),
            **({"pd": self.kv_link.stats()} if not isinstance(self.kv_link, NoKvLink) else {}),
            **({"audit": self.runner.audit.summary()} if self.runner.audit is not None else {}),
            **({"grammar_cache": self._grammars.stats()} if self._grammars is not None else {}),
        }
