"""Continuous batching: which sequences run in the next step and with how many tokens.

Decoding sequences go first (one token each), then prefills continue in chunks, then
waiting requests start, all within a per-step token budget. Prompts that arrive while
others stream are prefilled under a smaller cap: every decoding stream waits for the whole
step, and a step's time grows with its prefill tokens (~0.5 ms each for the bundled model on
a 2-core CPU, ~1 s for a full 2048-token step), so the cap bounds the gap between tokens.
Prompts that were already waiting when the engine's streams began (a burst into an idle
engine) keep the full budget while only their own tenant's streams decode: capping them only
moved their first tokens later (the fixed bench workload's TTFT p99 1.6-2x) for streams that had
just begun, but another tenant's stream is not held up by them. The streams begin with the first
token after the engine was idle (nothing running), and go on until it is idle again: a prompt
that queued while the engine was busy is capped, even if the streams it queued behind have
ended (on a backlogged engine it would otherwise stall the newer streams with whole-budget
steps). When the pool runs out, a sequence of the tenant running the most is preempted
(its last in line: decodes before prefills, then by arrival), among the one that needs the
page and those behind it (the ones ahead already have their pages for this step): its whole
pages go to its own cache scope and back to the pool, and on its return it attaches those a
grant has not evicted meanwhile (a chain's tail is evicted first) and recomputes the rest.
A step that preempts starts no waiting request (as vLLM's scheduler does): on a short pool
the newcomer was the next victim, and its prompt was computed again each time.

While requests wait, the prefills already running leave a quarter of the step's prefill room
(the budget, or the cap in force) to them, and whatever the newcomers do not take goes back to
the running prefills at the end of the step. Without it a long prompt took every step until it
was done: a tenant's 7000-token prompt held every other tenant's first token for 11-18 s on a
2-core CPU, and how long told them the prompt's length. Now a newcomer starts in the next
step; the step is as full as before. The cap counts the capped prompts' tokens only: a burst's
uncapped prompt beside streams used it up too, and kept every capped newcomer out until it was
done (found in review).

Running prefills of different tenants share each step's prefill room (and the cap, for those
under it) equally; each tenant's part goes to its prompts in arrival order, and what a tenant
does not use goes to the others at the end of the step. In arrival order alone, a prompt too
long to finish in its first step then waited for every earlier prompt: another tenant's
2,500-token prompt beside a 7,000-token one had its first token after 9.8 s, when the long
one was done (4.0 s with the shares), and its wait told it the other prompt's length. One
tenant's prompts keep arrival order.

Waiting requests start tenant by tenant, not in arrival order: the next one is the oldest of
the tenant with the fewest running sequences (ties: the tenant that last started one longest
ago). A tenant that queues a thousand requests gets
the free slots in turn with everyone else's, instead of making each later tenant wait for all
of them. With one tenant it is arrival order. One tenant's sequences hold at most
`max_seqs_per_tenant` of the running slots (3/4 of max_num_seqs behind a tenants file, all of
them without one): nothing running is preempted to make room, so without that share a tenant's
requests of n=16 held all 256 slots and another tenant's first token waited minutes for them.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfence.engine.request_states import Event, State
from kvfence.engine.sequence import Sequence
from kvfence.kv.ledger import Ledger
from kvfence.kv.prefix_cache import PrefixCache

# while requests wait, running prefills leave them 1/QUEUE_SHARE of the step's prefill room
QUEUE_SHARE = 4


@dataclass
class TenantShares:
    """What each tenant's running prefills may take of one step (Scheduler._tenant_shares);
    what they leave goes to the others at the end of the step (_give_back)."""
    whole: int        # of the step's prefill room
    of_cap: int       # of the cap, for prefills under it
    bounded: bool     # several tenants: the shares apply (one tenant keeps the whole room)
    spent: Counter = field(default_factory=Counter)
    spent_capped: Counter = field(default_factory=Counter)

    def left(self, tenant: str, capped: bool) -> int:
        if not self.bounded:
            return 1 << 62
        left = self.whole - self.spent[tenant]
        return min(left, self.of_cap - self.spent_capped[tenant]) if capped else left

    def spend(self, tenant: str, capped: bool, n: int) -> None:
        self.spent[tenant] += n
        if capped:
            self.spent_capped[tenant] += n


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int   # tokens computed for it in this step


class Scheduler:
    def __init__(self, ledger: Ledger, max_num_seqs: int, token_budget: int,
                 prefix_cache: PrefixCache | None = None, prefill_budget_while_decoding: int | None = None,
                 tenant_running_share: float = 1.0):
        self.ledger = ledger
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        # the most running sequences one tenant may hold (EngineConfig.tenant_running_share)
        self.max_seqs_per_tenant = max(1, int(max_num_seqs * tenant_running_share))
        self.token_budget = token_budget
        # prefill tokens a step may hold when it also decodes; None: the whole token budget
        self.prefill_budget_while_decoding = prefill_budget_while_decoding
        # the first token since the engine was last idle (None: none yet); a prompt that arrived
        # after it is capped
        self.streaming_since: float | None = None
        self._decoding_tenants: set[str] = set()   # whose streams decode this step
        self._waiting_tenants: set[str] = set()    # whose requests wait to start this step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._starts = 0                          # starts so far; a tenant's last one (round robin)
        self._last_start: dict[str, int] = {}
        self.unservable: list[Sequence] = []  # could not get pages even alone; the engine aborts them
        # PD requests hold pool pages outside this scheduler (a computed prompt waiting for
        # transfer rows, a reservation awaiting its transfer); those pages come back, so
        # while any are held a request that does not fit now waits instead of failing
        self.pages_held_elsewhere: Callable[[], bool] = lambda: False

    def add(self, seq: Sequence) -> None:
        assert seq.state is State.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A PD decode request whose transferred KV was verified: it holds its prompt's pages
        and grows from there like any running request."""
        assert seq.state is State.DECODING and seq.reserved
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def sequences_by_tenant(self) -> dict[str, dict[str, int]]:
        """tenant -> its sequences running and waiting (for /metrics: whether one tenant holds
        the slots while another waits)."""
        out: dict[str, dict[str, int]] = {}
        for state, seqs in (("running", self.running), ("waiting", self.waiting)):
            for s in seqs:
                out.setdefault(s.tenant, {"running": 0, "waiting": 0})[state] += 1
        return out

    def _victim_after(self, seq: Sequence, idle: list[Sequence]) -> Sequence | None:
        """Who gives up its pages so that seq can go on: of seq, the sequences behind it and
        the `idle` ones ahead of it (those skipped this step for their tenant's spent share;
        the others ahead are scheduled already), the last of the tenant running the most. None
        when that is seq itself (then it waits, or is preempted, below)."""
        load = Counter(s.tenant for s in self.running)
        candidates = idle + self.running[self.running.index(seq):]
        victim = max(reversed(candidates), key=lambda s: load[s.tenant])   # the first maximum: the last in line
        return None if victim is seq else victim

    def _preempt(self, victim: Sequence) -> None:
        # a PD decode request too: its transferred KV goes back with its pages and is
        # recomputed here from its tokens, like any preempted request. With a prefix cache (not
        # on a PD decode node) its whole pages go to its own cache scope first, as a finished
        # request's do (I9): evicted only when a grant needs them, what survives is attached
        victim.reserved = False
        if self.prefix_cache is not None:
            self.prefix_cache.publish(victim.owner, victim.cache_scope, victim.all_ids, victim.table,
                                      victim.publishable)
        self.ledger.free(victim.owner, victim.table)
        victim.num_computed = 0
        victim.num_preemptions += 1
        victim.on(Event.PREEMPT)
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _next_waiting(self, running_by_tenant: Counter) -> int | None:
        """The index in `waiting` of the request to start next: the first one (the oldest, or
        a preempted one put back in front) of the tenant with the fewest running sequences,
        and among those the one whose last start is longest ago (round robin). Choices that
        wait for their lead's prefill are passed over (None: only those wait)."""
        best, best_key = None, None
        seen: set[str] = set()
        for i, seq in enumerate(self.waiting):
            if seq.tenant in seen or seq.waits_for_lead:
                continue
            seen.add(seq.tenant)
            key = (running_by_tenant[seq.tenant], self._last_start.get(seq.tenant, -1))
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _capped(self, seq: Sequence, starting: bool = False) -> bool:
        """Whether seq's prefill is under the cap while streams decode: it arrived after the
        engine's streams began (a burst's prompts, there before them, are not), or another
        tenant's stream decodes (a fairness probe: a tenant's burst of two 7,500-token prompts,
        uncapped, stalled another tenant's stream for 2-4 s a token; the burst's own streams
        may wait for it, another tenant's may not). Also while another tenant's request waits
        to start: its first token comes after the step in progress and the next, which the cap
        keeps short (a side-channel probe: one tenant's eight 4,000-token prompts held another
        tenant's first token 3-7 s). `starting`: a waiting request that starts now, which that
        rule leaves alone (it would hold the very newcomer it is for, and a PD prefill node's
        arrivals of two tenants, to the cap: a review measured prefills taking twice the steps)."""
        streaming = self.streaming_since is not None and (
            seq.arrival > self.streaming_since or bool(self._decoding_tenants - {seq.tenant}))
        return streaming or (not starting and bool(self._waiting_tenants - {seq.tenant}))

    def _prefill_room(self, budget: int, capped_so_far: int, capped: bool, for_queue: bool = False) -> int:
        """Prefill tokens the step can still take: the budget left (decodes count in it too),
        and for a capped prefill what the cap leaves after the capped prefills already in the
        step (an uncapped one, left from a burst, does not use the cap up: counted, it kept
        every capped newcomer out until it was done). for_queue: keep the waiting requests'
        share of the room out of it (a running prefill, while some wait)."""
        cap = self.prefill_budget_while_decoding
        # the queue's quarter is of the room a step can have: a cap above the budget does not
        # bind (a quarter of it taken from a smaller budget left the prefills nothing, and a node
        # whose pool they held never moved again: found by the simulation's n > 1 campaigns)
        room, whole = ((min(budget, cap - capped_so_far), min(cap, self.token_budget)) if capped and cap is not None
                       else (budget, self.token_budget))
        return room - whole // QUEUE_SHARE if for_queue else room

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.token_budget
        out: list[ScheduledSeq] = []
        decoding = [s for s in self.running if s.state is State.DECODING]
        self._decoding_tenants = {s.tenant for s in decoding}
        # tenants with a request that could start now: a free running slot, and the tenant under its
        # running share (one at its share could keep a request waiting to hold everyone else to
        # the cap while its own prefills ran uncapped: a review's starvation lever)
        running_now = Counter(s.tenant for s in self.running)
        self._waiting_tenants = {s.tenant for s in self.waiting
                                 if running_now[s.tenant] < self.max_seqs_per_tenant and not s.waits_for_lead} \
            if len(self.running) < self.max_num_seqs else set()
        if not self.running:
            self.streaming_since = None     # idle: what waits now is a burst
        elif self.streaming_since is None and decoding:
            # a PD decode request has no first token here: it streams already, all are capped
            self.streaming_since = min(-math.inf if s.first_token_at is None else s.first_token_at for s in decoding)
        capped_so_far = 0     # prefill tokens of capped prompts in this step
        preempted_before = self.num_preemptions
        # Decoding sequences first so a long prefill never stalls token streams.
        self.running.sort(key=lambda s: (s.state is not State.DECODING, s.arrival))
        # requests wait that could start this step: running prefills leave them their share
        for_queue = bool(self.waiting) and len(self.running) < self.max_num_seqs
        i = 0
        shares: TenantShares | None = None
        idle: list[Sequence] = []   # prefills skipped for their tenant's spent share: pages held, nothing run
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_decode = seq.state is State.DECODING
            capped = self._capped(seq)
            n = min(seq.uncomputed, budget if is_decode else
                    self._prefill_room(budget, capped_so_far, capped, for_queue))
            if n <= 0 and not is_decode:
                break   # only prefills are left (decodes sort first) and the cap is spent
            if not is_decode:
                if shares is None:   # the first prefill: decodes (sorted first) have taken theirs
                    shares = self._tenant_shares(self.running[i:], budget, for_queue)
                n = min(n, shares.left(seq.tenant, capped))
                if n <= 0:
                    idle.append(seq)
                    i += 1   # its tenant's share is spent; another tenant's prefill may still run
                    continue
            need = self.ledger.pages_for(seq.num_computed + n) - len(seq.table)
            preempted = False
            while need > self.ledger.num_available and (victim := self._victim_after(seq, idle)) is not None:
                self._preempt(victim)
                preempted = True
                if victim in idle:
                    idle.remove(victim)
            if preempted:   # an idle one ahead of seq may have left the list
                i = self.running.index(seq)
            if need > self.ledger.num_available:
                if self.pages_held_elsewhere():
                    # those pages come back: keep this one's pages and computed KV and skip
                    # it this step (preempting it would only recompute the same chunk)
                    i += 1
                    continue
                if not out and len(self.running) == 1:
                    self.running.remove(seq)
                    self.unservable.append(seq)
                else:
                    self._preempt(seq)
                continue
            self.ledger.allocate(seq.owner, need, seq.table)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            if not is_decode and capped:
                capped_so_far += n
            if shares is not None and not is_decode:
                shares.spend(seq.tenant, capped, n)
            i += 1
        running_by_tenant = Counter(s.tenant for s in self.running)
        # a step that had to preempt starts nothing: the pages are short, and a newcomer would
        # be the next shortage's victim, its prompt computed again each time
        while self.waiting and len(self.running) < self.max_num_seqs and self.num_preemptions == preempted_before:
            at = self._next_waiting(running_by_tenant)
            if at is None:
                break   # every waiting one is a choice whose lead has not computed the prompt yet
            seq = self.waiting[at]
            if running_by_tenant[seq.tenant] >= self.max_seqs_per_tenant:
                break   # the tenant running the fewest holds its share: so does every tenant waiting
            capped = self._capped(seq, starting=True)
            if self._prefill_room(budget, capped_so_far, capped) <= 0:
                break
            if self.prefix_cache is not None and seq.reads_prefix_cache:
                seq.num_computed = self.prefix_cache.match(seq.owner, seq.cache_scope, seq.all_ids, seq.table)
                if seq.num_preemptions == 0:
                    seq.cached_tokens = seq.num_computed
            n = min(seq.uncomputed, self._prefill_room(budget, capped_so_far, capped))
            need = self.ledger.pages_for(seq.num_computed + n) - len(seq.table)
            if need > self.ledger.num_available:
                if self.prefix_cache is not None and seq.reads_prefix_cache:
                    self.prefix_cache.unmatch(seq.all_ids, seq.num_computed)
                    if seq.num_preemptions == 0:
                        seq.cached_tokens = 0   # none used yet (its usage must not claim them if it ends here)
                self.ledger.free(seq.owner, seq.table)  # let go of any cached pages just attached
                seq.num_computed = 0
                # nothing will ever free pages for it (an unservable one's go back after this schedule)
                if not self.running and not self.pages_held_elsewhere() and not any(s.table for s in self.unservable):
                    del self.waiting[at]
                    self.unservable.append(seq)
                    continue
                break   # the chosen one waits for pages; a smaller one behind it does not overtake it
            del self.waiting[at]
            seq.after = None   # started: the lead is no longer needed (nor kept alive by it)
            self.ledger.allocate(seq.owner, need, seq.table)
            seq.on(Event.SCHEDULE)
            if seq.started_at is None:   # its wait to run ends (kvfence_queue_wait_seconds); not a resume
                seq.started_at = time.perf_counter()
            self.running.append(seq)
            running_by_tenant[seq.tenant] += 1
            self._starts += 1
            self._last_start[seq.tenant] = self._starts
            out.append(ScheduledSeq(seq, n))
            budget -= n
            if capped:
                capped_so_far += n
        if for_queue or (shares is not None and shares.bounded):
            self._give_back(out, budget, capped_so_far)
        return out

    def _tenant_shares(self, prefills: list[Sequence], budget: int, for_queue: bool) -> TenantShares:
        """Each tenant's share of the step's prefill room: an equal part of the room for all
        tenants with a running prefill (the cap's room when every one is capped), and of the
        cap's room for those capped; each after what is kept for the queue (shares of the
        whole cap let the first three capped tenants take the three quarters left of it, and a
        fourth had nothing until one of them was done: found in review)."""
        every = {s.tenant for s in prefills}
        capped = {s.tenant for s in prefills if self._capped(s)}
        return TenantShares(
            whole=max(1, self._prefill_room(budget, 0, capped == every, for_queue) // len(every)),
            of_cap=max(1, self._prefill_room(budget, 0, True, for_queue) // max(1, len(capped))),
            bounded=len(every) > 1)

    def _give_back(self, out: list[ScheduledSeq], budget: int, capped_so_far: int) -> None:
        """The room kept for the queue, and the tenants' shares, that they did not take goes to
        the running prefills, as far as the free pages hold it (no preemption for it): in
        rounds, an equal part of what is left to each tenant with a prefill that can take more
        (of the tokens, of the cap for capped prefills, of the free pages), a tenant's part to
        its prompts in arrival order. (In arrival order alone, the earliest tenant's prompt took
        all of it: 5/8 of the step against 3/8 beside a waiting request.)"""
        planned = {id(s.seq): s for s in out}
        takers = [s for s in self.running if s.state is not State.DECODING]
        cap = self.prefill_budget_while_decoding
        while budget > 0 and takers:
            by_tenant: dict[str, list[Sequence]] = {}   # in arrival order
            for seq in takers:
                by_tenant.setdefault(seq.tenant, []).append(seq)
            part = max(1, budget // len(by_tenant))
            capped_tenants = sum(any(self._capped(q) for q in seqs) for seqs in by_tenant.values())
            cap_part = max(1, (cap - capped_so_far) // capped_tenants) if cap is not None and capped_tenants else None
            page_part = max(1, self.ledger.num_available // len(by_tenant))
            given, spent = 0, set()
            for seqs in by_tenant.values():
                tokens, cap_left, pages = min(part, budget), cap_part, page_part
                for seq in seqs:
                    capped = self._capped(seq)
                    room = min(tokens, cap_left) if capped and cap_left is not None else tokens
                    if room <= 0 or pages <= 0:
                        break   # the tenant's part of this round is used: the next round shares again
                    free = self.ledger.num_available
                    extra = self._give(seq, planned, out, room, capped_so_far, pages)
                    if extra <= 0:
                        spent.add(id(seq))   # done, the cap spent, or no pages: it takes no more this step
                        continue
                    pages -= free - self.ledger.num_available
                    tokens -= extra
                    budget -= extra
                    given += extra
                    if capped:
                        capped_so_far += extra
                        if cap_left is not None:
                            cap_left -= extra
            takers = [q for q in takers if id(q) not in spent]
            if given == 0:
                return

    def _give(self, seq: Sequence, planned: dict[int, ScheduledSeq], out: list[ScheduledSeq], room: int,
              capped_so_far: int, pages: int) -> int:
        """Up to `room` more tokens of seq's prompt in this step, on at most `pages` more free
        pages (planned: what each sequence has in the step already, by id); returns how many."""
        s = planned.get(id(seq))
        done = s.num_new if s is not None else 0
        extra = min(seq.uncomputed - done, self._prefill_room(room, capped_so_far, self._capped(seq)),
                    # what its pages and the free ones hold: part of the room rather than none
                    (len(seq.table) + min(pages, self.ledger.num_available)) * self.ledger.page_size
                    - (seq.num_computed + done))
        if extra <= 0:
            return 0
        self.ledger.allocate(seq.owner, self.ledger.pages_for(seq.num_computed + done + extra) - len(seq.table),
                             seq.table)
        if s is None:
            planned[id(seq)] = s = ScheduledSeq(seq, extra)
            out.append(s)
        else:
            s.num_new += extra
        return extra
