"""The one table of a request's life, single node and prefill/decode alike.

Every state change of every request goes through `advance()`; a transition that is
not in TRANSITIONS raises. The Promela model in spec/ uses the same state and event
names, and a test keeps the two in step.
"""
from __future__ import annotations

import enum


class State(str, enum.Enum):
    NEW = "NEW"                  # created, not yet admitted
    REJECTED = "REJECTED"        # terminal: refused at admission; never holds pages
    WAITING = "WAITING"          # admitted, queued for pages (also after preemption)
    PREFILLING = "PREFILLING"    # holds pages, computing the prompt in chunks
    KV_HELD = "KV_HELD"          # PD prefill: prompt KV computed, pages held under a lease
    AWAITING_KV = "AWAITING_KV"  # PD decode: pages reserved, transfer not yet verified
    DECODING = "DECODING"        # generating tokens
    FINISHED = "FINISHED"        # terminal: ended normally, pages returned
    ABORTED = "ABORTED"          # terminal: error, disconnect or violation; pages freed or quarantined


class Event(str, enum.Enum):
    ADMIT = "ADMIT"
    REJECT = "REJECT"
    SCHEDULE = "SCHEDULE"          # pages granted, prefill may start
    PREFILL_DONE = "PREFILL_DONE"  # single node: prompt computed, first token sampled
    PREEMPT = "PREEMPT"            # pool ran out: pages freed, recompute later
    HOLD_KV = "HOLD_KV"            # PD prefill: keep the computed pages for the decode pull
    RELEASE = "RELEASE"            # PD prefill: decode acknowledged the transfer
    RESERVE = "RESERVE"            # PD decode: pages reserved for an incoming transfer
    VERIFY = "VERIFY"              # PD decode: every page arrived and checked (I5)
    FINISH = "FINISH"
    ABORT = "ABORT"


TERMINAL = frozenset({State.REJECTED, State.FINISHED, State.ABORTED})

# (state, event) -> next state. Nothing leaves a terminal state; REJECTED in
# particular never leads to a transfer or to decoding (I4).
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.ADMIT): State.WAITING,
    (State.NEW, Event.REJECT): State.REJECTED,
    (State.WAITING, Event.SCHEDULE): State.PREFILLING,
    (State.WAITING, Event.RESERVE): State.AWAITING_KV,
    (State.WAITING, Event.ABORT): State.ABORTED,
    (State.PREFILLING, Event.PREFILL_DONE): State.DECODING,
    (State.PREFILLING, Event.HOLD_KV): State.KV_HELD,
    (State.PREFILLING, Event.PREEMPT): State.WAITING,
    (State.PREFILLING, Event.FINISH): State.FINISHED,
    (State.PREFILLING, Event.ABORT): State.ABORTED,
    (State.KV_HELD, Event.RELEASE): State.FINISHED,
    (State.KV_HELD, Event.ABORT): State.ABORTED,
    (State.AWAITING_KV, Event.VERIFY): State.DECODING,
    (State.AWAITING_KV, Event.ABORT): State.ABORTED,
    (State.DECODING, Event.PREEMPT): State.WAITING,
    (State.DECODING, Event.FINISH): State.FINISHED,
    (State.DECODING, Event.ABORT): State.ABORTED,
}


class IllegalTransition(RuntimeError):
    pass


def advance(state: State, event: Event) -> State:
    """Return the state after `event`, or raise if the table does not allow it."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event.value} is not allowed in state {state.value}") from None
