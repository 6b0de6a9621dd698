"""The one state table: illegal moves raise, and REJECTED leads nowhere (I4)."""
from __future__ import annotations

import pytest

from kvfence.engine.request_states import TERMINAL, TRANSITIONS, Event, IllegalTransition, State, advance


def reachable(start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        s = todo.pop()
        for (frm, _), to in TRANSITIONS.items():
            if frm == s and to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_terminal_states_have_no_way_out():
    for (frm, _ev) in TRANSITIONS:
        assert frm not in TERMINAL


def test_rejected_never_reaches_transfer_or_decode():
    assert reachable(State.REJECTED) == {State.REJECTED}
    for ev in Event:
        with pytest.raises(IllegalTransition):
            advance(State.REJECTED, ev)


def test_decode_needs_prefill_or_a_verified_transfer():
    into_decoding = {frm for (frm, ev), to in TRANSITIONS.items() if to is State.DECODING}
    assert into_decoding == {State.PREFILLING, State.AWAITING_KV}
    assert TRANSITIONS[(State.AWAITING_KV, Event.VERIFY)] is State.DECODING


def test_every_state_can_end():
    for s in State:
        assert reachable(s) & TERMINAL, s


def test_unknown_transition_raises_with_names():
    with pytest.raises(IllegalTransition, match="VERIFY is not allowed in state WAITING"):
        advance(State.WAITING, Event.VERIFY)
