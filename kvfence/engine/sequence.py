"""One request inside the engine: its tokens, its pages and its place in the state table."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvfence.engine.params import SamplingParams
from kvfence.engine.request_states import TERMINAL, Event, State, advance
from kvfence.kv.ledger import PUBLIC_SCOPE, BlockTable, Owner

if TYPE_CHECKING:
    from kvfence.engine.detokenizer import IncrementalDetokenizer
    from kvfence.engine.grammar import Constraint
    from kvfence.engine.logits_processors import FixedAdjustments, TokenCounts
    from kvfence.pd.messages import Handoff

_numbers = itertools.count(1)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    request_id: str
    tenant: str
    owner: Owner
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int                          # resolved: never None here
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    state: State = State.NEW
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0                    # tokens whose K/V are in this request's pages
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: entry i is prompt token i + 1's (the first token has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    abort_code: str | None = None            # why an aborted request ended (server/app.py maps the codes)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    started_at: float | None = None   # its first step (perf_counter): the wait for a running slot ends
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    cache_scope: str = ""                    # prefix-cache scope name (the tenant's own by default)
    cached_tokens: int = 0                   # prompt tokens served from the prefix cache
    grammar: Constraint | None = None        # structured output: where its grammar is (engine/grammar.py)
    token_counts: TokenCounts | None = None  # penalties' counts, kept a token at a time (logits_processors.py)
    fixed_adjustments: FixedAdjustments | None = None   # logit_bias and min_tokens' ids as tensors (same file)
    # PD (kvfence/pd): a prefill node computes the prompt but its last token and holds the
    # KV for decode (hold_kv); a decode node gets the prompt's pages at RESERVE and fills
    # them from kv_source (reserved: until it runs; preempted later, it recomputes its KV).
    hold_kv: bool = False
    reserved: bool = False
    kv_source: Handoff | None = None         # decode: the manifest and where to pull it from
    # another choice of the same prompt (a request's n > 1) whose prefill this one waits for,
    # so that it attaches those prompt pages from the prefix cache instead of computing them
    after: Sequence | None = None

    @staticmethod
    def next_number() -> int:
        return next(_numbers)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def publishable(self) -> int:
        """Computed tokens whose whole pages may go to the prefix cache: all of them in the
        tenant's own scope; in an opted-in public scope only the prompt's, since the opt-in
        shares prompt prefixes, not what the model wrote for one tenant (another tenant sending
        a guess of it would learn from its cached_tokens whether the guess was right)."""
        if self.cache_scope.startswith(PUBLIC_SCOPE):
            return min(self.num_computed, len(self.prompt_ids))
        return self.num_computed

    @property
    def reads_prefix_cache(self) -> bool:
        """May the scheduler attach cached prefix pages? Not while prompt logprobs are owed:
        a cached position runs no LM head, so its logprob would be lost. Recomputing it means
        computing its K/V again, which can only go into pages this request owns (shared
        pages are read-only, I9): skipping the lookup is the recompute, at the same cost."""
        return self.params.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_ids) - 1

    @property
    def waits_for_lead(self) -> bool:
        """Not startable yet: its lead has not computed the prompt once (waiting or prefilling,
        no token sampled). A lead that ended, or has sampled a token, leaves its full prompt
        pages in the scope's prefix cache; one preempted after that is not waited for again."""
        lead = self.after
        return lead is not None and lead.state in (State.WAITING, State.PREFILLING) and not lead.output_ids

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def on(self, event: Event) -> None:
        self.state = advance(self.state, event)
