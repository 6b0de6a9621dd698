"""The Promela model and the code's state table must not drift apart.

Reads kvfence/engine/request_states.py and spec/handoff.pml (no spin needed) and
fails when a state or event name differs, when the model performs a transition
the table does not allow, or when the table gains a transition the model neither
uses nor lists below as deliberately unused.
"""
from __future__ import annotations

import re

import pytest

from kvfence.engine.request_states import TERMINAL, TRANSITIONS, Event, State
from promela_tools import ADVERSARY_MUTANTS, MODEL, MUTANTS, SPEC, advances, mtype_names, preprocess

SOURCE = MODEL.read_text()

# Table transitions the PD model deliberately does not perform: they belong to
# single-node serving. Listed one by one so that a new table entry fails this
# test until someone decides whether the PD protocol uses it.
UNUSED_IN_MODEL = {
    (State.PREFILLING, Event.PREFILL_DONE): "single node: prompt computed, decode on the same node",
    (State.PREFILLING, Event.PREEMPT): "single node: pool pressure, recompute later",
    (State.DECODING, Event.PREEMPT): "single node: a PD decode node cannot recompute the prompt",
    (State.PREFILLING, Event.FINISH): "single node: the request ends at prefill (max_tokens=0)",
}


def table() -> set[tuple[str, str, str]]:
    return {(s.value, e.value, t.value) for (s, e), t in TRANSITIONS.items()}


def test_state_names_match_the_table():
    assert mtype_names(SOURCE, "state") == [s.value for s in State]


def test_event_names_match_the_table():
    assert mtype_names(SOURCE, "event") == [e.value for e in Event]


def test_terminal_states_match_the_table():
    m = re.search(r"#define\s+TERMINAL\(s\)\s*(.*)", SOURCE)
    assert m, "no TERMINAL(s) macro in the model"
    assert set(re.findall(r"==\s*(\w+)", m.group(1))) == {s.value for s in TERMINAL}


def test_model_performs_only_table_transitions():
    used = advances(SOURCE)
    assert used, "no advance() calls found: the regex or the model changed"
    illegal = [a for a in used if (a.frm, a.event, a.to) not in table()]
    assert not illegal, "transitions the table does not allow:\n" + "\n".join(
        f"  handoff.pml:{a.line} {a.node}: {a.frm} -{a.event}-> {a.to}" for a in illegal)


def test_model_covers_every_pd_transition_of_the_table():
    used = {(a.frm, a.event, a.to) for a in advances(SOURCE)}
    unused = {(s.value, e.value, TRANSITIONS[(s, e)].value) for s, e in UNUSED_IN_MODEL}
    assert unused <= table(), "UNUSED_IN_MODEL names a transition the table no longer has"
    assert not (used & unused), "the model uses a transition listed as unused: update UNUSED_IN_MODEL"
    missing = table() - used - unused
    assert not missing, (
        "table transitions the model neither performs nor lists as unused "
        f"(model them, or add them to UNUSED_IN_MODEL with a reason): {sorted(missing)}")


def test_only_node_records_change_state():
    for a in advances(SOURCE):
        assert a.node in ("prefill", "decode"), f"handoff.pml:{a.line}: advance() on {a.var}"


def test_every_state_change_goes_through_advance():
    """ps[..] and ds[..] are assigned only inside advance(), or set to NEW by init."""
    for number, line in preprocess(SOURCE):
        for m in re.finditer(r"\b([pd]s\[[^\]]*\])\s*=(?!=)\s*(\w+)", line):
            assert m.group(2) == "NEW", (
                f"handoff.pml:{number}: {m.group(1)} = {m.group(2)} bypasses advance()")


@pytest.mark.parametrize("key", sorted(MUTANTS))
def test_mutant_is_a_small_switch_on_the_model(key):
    """Each mutant file switches on one #ifdef block of the model, and the mutant
    breaks a page-safety property, not the state table."""
    name, _ = MUTANTS[key]
    text = (SPEC / "mutants" / name).read_text()
    macro = f"MUTANT_{key.upper()}"
    assert re.search(rf"^#define\s+{macro}\s*$", text, flags=re.M)
    assert re.search(r'^#include\s+"\.\./handoff\.pml"\s*$', text, flags=re.M)
    assert len(re.findall(rf"#\s*ifdef\s+{macro}\b", SOURCE)) == 1, f"one #ifdef {macro} block"
    base = frozenset({"ADVERSARY"}) if key in ADVERSARY_MUTANTS else frozenset()
    if base:
        assert re.search(r"^#define\s+ADVERSARY\s*$", text, flags=re.M)
    # the mutated code must differ from the clean code, and be small
    clean = [line for _, line in preprocess(SOURCE, base)]
    mutated = [line for _, line in preprocess(SOURCE, base | {macro})]
    assert clean != mutated
    changed = len(set(mutated) ^ set(clean))
    assert changed <= 12, f"{macro} changes {changed} lines: keep mutants small"
    illegal = [a for a in advances(SOURCE, base | {macro})
               if (a.frm, a.event, a.to) not in table()]
    assert not illegal, f"{macro} uses transitions outside the table: {illegal}"
