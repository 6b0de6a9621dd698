"""Which generation of a tenant's cache scope a PD node serves, per router.

A router's tenants-file reload retires a name's cache scope when the tenant is removed or all
its keys are replaced (perhaps another party under the old name). The router numbers its
reloads: a tenant's scope epoch is the number of the reload that last retired its name (0:
none in this router process), and every request it sends a node carries (router, epoch),
taken when the request's key was checked. The node keeps the highest epoch it has seen per
(router, tenant) and, before admitting a stamped request, compares:

- older: the request was sent before a retirement the node already carried out. Its key was
  revoked with it and the router's abort is on its way; admitted now it would run, and publish
  its prompt, under the name's new scope. Refused (ScopeRetired).
- newer: the node missed the router's forget message (it was unreachable, or the message is
  still on its way). It retires the scope first, queued ahead of the request, so the new party
  attaches none of the old party's pages.
- the same: admitted, unless a retirement recorded for the pair failed (retire_again): then
  it is retired first, as for a newer one.

The forget message records its epoch the same way and retires only what is newer (or the
same after a failed retirement), so a late one does not drop the new party's pages again. A
restarted router is a new router id with no history: the node keeps each router id's tenants
in their own cache scopes (ledger.scope_name), so a new id starts with nothing, whatever the
old one left unretired. The table is bounded: the pair least recently used is dropped first,
and its router keeps the highest epoch it dropped as a floor; a pair unknown here from a
router with a floor is retired before its first request, whatever its stamp (cache, never
isolation).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from kvfence.pd.messages import ScopeStamp

log = logging.getLogger(__name__)

MAX_PAIRS = 1 << 16   # (router, tenant) pairs remembered


class ScopeRetired(Exception):
    """A request stamped with a scope epoch older than one this node already retired."""


class ScopeEpochs:
    def __init__(self, max_pairs: int = MAX_PAIRS):
        self._known: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._floor: dict[str, int] = {}   # router -> the highest epoch of its pairs dropped for room
        self._again: set[tuple[str, str]] = set()   # pairs whose recorded retirement did not happen
        self._max = max_pairs

    def admit(self, stamp: ScopeStamp | None, tenant: str) -> bool:
        """Whether the tenant's scope must be retired before this request is admitted (its
        epoch is new here; recorded now), or ScopeRetired for a stale one. Call it in the same
        event-loop step as the request's submission, so that no forget message nor another
        request's retirement comes between the answer and the engine's command queue."""
        if stamp is None:   # not sent by a router (a test harness, the canary's direct use)
            return False
        pair = (stamp.router, tenant)
        known = self._known.get(pair)
        if known is not None:
            self._known.move_to_end(pair)
            if stamp.epoch < known:
                raise ScopeRetired(f"tenant {tenant!r}'s cache scope was retired by the router's reload {known}; "
                                   f"this request was sent under reload {stamp.epoch} (its key was revoked)")
            if stamp.epoch == known and pair not in self._again:
                return False
        elif stamp.epoch == 0 and stamp.router not in self._floor:   # nothing retired by that router here
            return False
        self._remember(pair, stamp.epoch)
        return True

    def retire_again(self, router: str, tenant: str, epoch: int) -> None:
        """The retirement recorded for this pair at `epoch` did not happen: the pair's next
        request or forget message retires again, unless a newer one has been recorded since
        (queued after the failed one, it retires the scope itself). The epoch stays: stamps
        older than it are still refused, their keys were revoked whichever retirement failed
        (going back to the epoch before the failed one let a stale stamp in when a later
        retirement of the pair went through)."""
        if self._known.get((router, tenant)) == epoch:
            self._again.add((router, tenant))

    def forget(self, router: str, epoch: int, tenants: list[str]) -> list[str]:
        """The router's forget message: the names to retire now (those whose epoch is new
        here), recorded. Same event-loop step as the retirement's command, as for admit."""
        due = []
        for t in tenants:
            known = self._known.get((router, t))
            if known is None or epoch > known or (epoch == known and (router, t) in self._again):
                # unknown: perhaps dropped for room, so retire
                self._remember((router, t), epoch)
                due.append(t)
        return due

    def _remember(self, pair: tuple[str, str], epoch: int) -> None:
        self._again.discard(pair)   # retired (again) now; a failure marks it once more
        self._known[pair] = epoch
        self._known.move_to_end(pair)
        while len(self._known) > self._max:
            dropped, epoch = self._known.popitem(last=False)
            self._again.discard(dropped)   # unknown pairs of a router with a floor retire anyway
            self._floor[dropped[0]] = max(self._floor.get(dropped[0], 0), epoch)


class Outcome(Protocol):
    """A queued retirement's result: an asyncio future on a node, a concurrent one in the
    simulation (kvfence/sim/cluster.py), which runs this same gate."""
    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def add_done_callback(self, fn: Callable[[Any], object], /) -> object: ...


class ScopeGate:
    """The node's side of the scope table: it queues the retirements the table asks for, in
    the engine's one command queue (`retire(tenants, router)`), and remembers the last one
    queued per pair until it is done. A request admitted behind a retirement that then fails
    would run in the scope it was meant to leave, with the old party's cached prompts (found
    in review: a request of the new party, stamped the same epoch as the forget message, was
    admitted while that message's retirement was still queued). So admit() returns the
    retirement the request queues behind, and the engine, which runs that retirement first,
    refuses the request before admitting it when it did not happen (EngineLoop.submit's
    `behind`; the simulation, unretired()). A failed retirement marks its pairs to retire
    again: the next request or forget message of the pair queues one first."""

    def __init__(self, retire: Callable[[list[str], str | None], Outcome], max_pairs: int = MAX_PAIRS):
        self.table = ScopeEpochs(max_pairs)
        self._retire = retire
        # pair -> its last retirement, until done; router None: unstamped (a router from before stamps)
        self._queued: dict[tuple[str | None, str], Outcome] = {}
        self._unstamped_again: set[str] = set()   # plain scopes whose retirement failed (no table for them)
        # past max_pairs such names: every unstamped request retires its plain scope first, until
        # the node restarts (fails closed: no cache for unstamped traffic, rather than a dropped failure)
        self._unstamped_overflow = False
        self._max_pairs = max_pairs

    def admit(self, stamp: ScopeStamp | None, tenant: str) -> Outcome | None:
        """Before the request's submission, in the same event-loop step: ScopeRetired for a
        stale stamp, else the retirement its submission queues behind (its own when its epoch
        is new here), or None."""
        if stamp is None:   # no epochs to compare; a failed retirement is retried first all the same
            if self._unstamped_overflow or tenant in self._unstamped_again:
                self._queue(None, [tenant], 0)
            return self._queued.get((None, tenant))
        if self.table.admit(stamp, tenant):
            self._queue(stamp.router, [tenant], stamp.epoch)
        return self._queued.get((stamp.router, tenant))

    def forget(self, router: str, epoch: int, tenants: list[str]) -> Outcome | None:
        """The router's forget message: the retirement queued for the names new here, or None."""
        due = self.table.forget(router, epoch, tenants)
        return self._queue(router, due, epoch) if due else None

    def forget_unstamped(self, tenants: list[str]) -> Outcome:
        """A forget message without router and epoch (a router from before stamps): retire the
        names' plain scopes (should it fail, each name's next unstamped request retires first)."""
        return self._queue(None, tenants, 0)

    @staticmethod
    def unretired(behind: Outcome | None) -> bool:
        """After the submission: whether the scope it was admitted to still holds what a
        retirement ahead of it was to remove."""
        return behind is not None and (not behind.done() or behind.cancelled() or behind.exception() is not None)

    def _queue(self, router: str | None, tenants: list[str], epoch: int) -> Outcome:
        try:
            outcome = self._retire(tenants, router)
        except BaseException:   # not even queued (the engine stopped): recorded, so retire again
            self._again(router, tenants, epoch)
            raise
        for t in tenants:
            self._queued[(router, t)] = outcome
            if router is None:
                self._unstamped_again.discard(t)
        outcome.add_done_callback(lambda o: self._settled(o, router, tenants, epoch))
        return outcome

    def _settled(self, outcome: Outcome, router: str | None, tenants: list[str], epoch: int) -> None:
        latest = [t for t in tenants if self._queued.get((router, t)) is outcome]
        for t in latest:
            del self._queued[(router, t)]
        if outcome.cancelled() or outcome.exception() is not None:
            # a plain scope with a later retirement queued is retired by that one (the engine runs
            # them in order); a stamped pair's table already tells by its epoch (retire_again)
            self._again(router, latest if router is None else tenants, epoch)

    def _again(self, router: str | None, tenants: list[str], epoch: int) -> None:
        """The pairs' next request or forget message retires again."""
        for t in tenants:
            if router is None:
                if len(self._unstamped_again) < self._max_pairs:
                    self._unstamped_again.add(t)
                elif t not in self._unstamped_again and not self._unstamped_overflow:
                    self._unstamped_overflow = True
                    log.warning("over %d names' unstamped retirements failed: every unstamped request now "
                                "retires its scope first (no prefix cache for them until restart)", self._max_pairs)
            else:
                self.table.retire_again(router, t, epoch)
