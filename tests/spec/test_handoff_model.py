"""spin on the PD handoff model: the clean model verifies exhaustively, every run
of it terminates and reaches every transition and scenario it names, and every
mutant that reintroduces a known bug is caught with a counterexample.

Needs spin and gcc (see conftest.spin_tools). spec/README.md has the numbers.

Each search is single-threaded and this file's tests only read results, so all of them
(promela_tools.JOBS: three exhaustive searches, one per mutant) run at once on a pool of the
machine's cores; each test waits for its own. In a run of the whole suite they start when the
tests are collected, at the lowest CPU priority (conftest.py), in the time the other tests
leave the cores idle.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from promela_tools import JOBS, MODEL, MUTANTS, Campaign, PanResult, advances, background, reached_markers, run


@pytest.fixture(scope="module")
def campaign(spin_tools, tmp_path_factory):
    """The campaign conftest.py started when the tests were collected, else one started now."""
    started = background()
    if started is not None:
        yield started
        return
    c = Campaign(JOBS, tmp_path_factory.mktemp("spin"))
    yield c
    c.stop()


def assert_complete_and_clean(result: PanResult) -> None:
    out = result.output
    assert "Full statespace search" in out, out[-3000:]          # exhaustive, not bitstate
    assert "Search not completed" not in out, out[-3000:]
    assert "max search depth too small" not in out, out[-3000:]
    assert "assertion violated" not in out, out[-3000:]
    assert result.errors == 0, out[-3000:]
    assert result.returncode == 0, out[-3000:]


def test_clean_model_verifies_exhaustively(campaign):
    """Safety: all assertions (I1-I6, and the END_ checks at quiescence) and no
    invalid end state, over the full state space."""
    result = campaign["clean"].result().result
    print("clean model:", result.summary())
    assert_complete_and_clean(result)
    assert re.search(r"assertion violations\s+\+", result.output)
    assert re.search(r"invalid end states\s+\+", result.output)


def test_model_with_a_network_adversary_verifies(campaign):
    """I10/I11: an adversary on the network that reads every registered page at every step,
    overwrites one, splices another request's sealed row into this one's or replays one,
    or forges a control message: no plaintext in registered memory, no adversary bytes and
    no foreign row reach attention, every other property as in the clean model. Built with
    COVERAGE so that the search also shows each adversary scenario happens."""
    result = campaign["adversary"].result().result
    print("adversary model:", result.summary())
    assert_complete_and_clean(result)
    reached = set(re.findall(r"^REACHED (\w+) @\d+$", result.output, flags=re.M))
    adversary = {m for m in reached_markers(MODEL.read_text(), frozenset({"ADVERSARY"})) if m.startswith("adversary_")}
    assert adversary == {"adversary_splices_another_requests_row", "adversary_forges_a_control_message"}
    assert adversary <= reached, sorted(adversary - reached)


@pytest.fixture(scope="module")
def liveness_run(campaign) -> PanResult:
    """The search for non-progress cycles, with the COVERAGE probes compiled in."""
    result = campaign["liveness"].result().result
    print("cycle search:", result.summary())
    return result


def test_every_run_terminates(liveness_run):
    """No cycle at all: every run is finite and ends in the Watchdog's quiescence
    checks, so those checks are the 'eventually' properties (every request
    answered, every page free, nothing quarantined forever)."""
    assert re.search(r"non-progress cycles\s+\+", liveness_run.output)
    assert "non-progress cycle" not in liveness_run.output.split("Full statespace")[0]
    assert_complete_and_clean(liveness_run)


def test_every_transition_and_scenario_is_reachable(liveness_run):
    """No vacuous proof: every advance() in the model and every REACHED() scenario
    marker is executed somewhere in the state space."""
    source = MODEL.read_text()
    covered = {int(n) for n in re.findall(r"^COVER .* @(\d+)$", liveness_run.output, flags=re.M)}
    dead = [a for a in advances(source) if a.line not in covered]
    assert not dead, "unreachable transitions:\n" + "\n".join(
        f"  handoff.pml:{a.line} {a.node}: {a.frm} -{a.event}-> {a.to}" for a in dead)
    reached = set(re.findall(r"^REACHED (\w+) @\d+$", liveness_run.output, flags=re.M))
    markers = reached_markers(source)
    assert markers, "no REACHED() markers found"
    missing = sorted(set(markers) - reached)
    assert not missing, f"scenarios never reached: {missing}"


@pytest.mark.parametrize("key", sorted(MUTANTS))
def test_mutant_is_caught(campaign, key):
    _, properties = MUTANTS[key]
    done = campaign[f"mutant {key}"].result()
    model, result = done.model, done.result
    print(f"mutant {key}:", result.summary())
    assert result.errors >= 1, f"spin found no error in mutant {key}:\n{result.output[-3000:]}"
    violated = re.search(r"assertion violated .*\|\|(\w+)\)", result.output)
    assert violated, result.output[-3000:]
    assert violated.group(1) in properties, (
        f"mutant {key} broke {violated.group(1)}, expected one of {sorted(properties)}")
    # the counterexample replays
    trail = Path(f"{model}.trail")
    assert trail.exists(), f"no trail written for mutant {key}"
    replay = run(["spin", "-t", model.name], model.parent, 300)
    assert "assertion violated" in replay.stdout, replay.stdout[-3000:] + replay.stderr
    assert violated.group(1) in replay.stdout
