"""Named fault points (kvfence/faults.py) and the single-node ones wired into the engine.

For each wired fault: with it on, the defect reaches the model (the read audit, or
poisoned pages, show a foreign/stale read, or an over-length request running); with it
off, the enforcement it bypasses stops the same defect. And: nothing is enabled in a
production-style start, unknown names are refused, and the banner is loud.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import timeit
from pathlib import Path

import pytest

from kvfence import ContextLengthExceeded, SamplingParams, faults
from kvfence.engine.request_states import State

from .conftest import GREEDY, audited, claim_unwritten, point_at_neighbour, run_three, run_to_end

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_env_faults():
    """These tests decide what is enabled; a stray KVFENCE_TEST_FAULTS must not leak in."""
    assert not faults.enabled(), f"faults enabled outside a test: {faults.describe()}"
    yield
    assert not faults.enabled()


# -- the registry ------------------------------------------------------------------------

def test_nothing_is_enabled_without_the_test_setting():
    env = {k: v for k, v in os.environ.items() if k != faults.ENV_VAR}
    code = ("import logging, kvfence.faults as f; "
            "print(f.enabled(), f.banner(), f.any_active(), f.announce(logging.getLogger()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{}", "None", "False", "False"]


def test_the_environment_variable_enables_faults_and_the_banner_is_loud():
    env = {**os.environ, faults.ENV_VAR: "skip_watermark, delay_transfer_completion:2.5"}
    code = ("import logging, kvfence.faults as f; logging.basicConfig(); "
            "print(sorted(f.enabled().items())); print(f.arg_float('delay_transfer_completion', 1.0)); "
            "f.announce()")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[('delay_transfer_completion', '2.5'), ('skip_watermark', None)]"
    assert lines[1] == "2.5"
    assert "ERROR:kvfence.faults" in out.stderr and "FAULT INJECTION ACTIVE" in out.stderr
    assert "skip_watermark" in out.stderr and "delay_transfer_completion:2.5" in out.stderr


def test_an_unknown_name_in_the_environment_fails_the_import():
    env = {**os.environ, faults.ENV_VAR: "skip_ledger_chek"}
    out = subprocess.run([sys.executable, "-c", "import kvfence.faults"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "unknown fault 'skip_ledger_chek'" in out.stderr


def test_load_env_and_unknown_names():
    assert faults.load_env({faults.ENV_VAR: "kill_node_at:after_stage,skip_row_auth"}) == {
        "kill_node_at": "after_stage", "skip_row_auth": None}
    try:
        assert faults.active("skip_row_auth") and not faults.active("skip_watermark")
        assert faults.arg("kill_node_at") == "after_stage"
        with pytest.raises(faults.FaultConfigError, match="unknown"):
            faults.active("no_such_fault")
    finally:
        faults.load_env({})
    with pytest.raises(faults.FaultConfigError, match="unknown fault"):
        faults.load_env({faults.ENV_VAR: "skip_everything"})
    with pytest.raises(faults.FaultConfigError):
        with faults.injected("skip_everything"):
            pass


def test_injected_nests_and_restores():
    assert faults.banner() is None
    with faults.injected("skip_watermark"):
        with faults.injected(delay_transfer_completion=2.5):
            assert faults.active("skip_watermark") and faults.arg_float("delay_transfer_completion", 1) == 2.5
            assert "FAULT INJECTION ACTIVE" in faults.banner()
        assert not faults.active("delay_transfer_completion")
        assert faults.arg_float("delay_transfer_completion", 1.0) == 1.0
    assert not faults.active("skip_watermark") and faults.banner() is None


def test_every_fault_point_in_the_code_names_a_known_fault():
    used = set()
    for path in (ROOT / "kvfence").rglob("*.py"):
        used |= set(re.findall(r"faults\.(?:active|arg|arg_float)\(\s*[\"']([a-z_]+)[\"']", path.read_text()))
    assert used, "no fault point found"
    assert used <= set(faults.FAULTS), used - set(faults.FAULTS)
    assert {"skip_ledger_check", "skip_watermark", "skip_node_admission"} <= used


def test_a_disabled_fault_point_is_near_free():
    # one truth test of a module global: the same order as an empty function call
    per_call = min(timeit.repeat(lambda: faults.active("skip_ledger_check"), number=20000, repeat=5)) / 20000
    assert per_call < 5e-6


# -- wired faults, with the engine ----------------------------------------------------------

@pytest.mark.parametrize("on", [True, False], ids=["fault_on", "fault_off"])
def test_skip_ledger_check(make_llm, on):
    llm = make_llm()
    audit = audited(llm)
    if on:
        with faults.injected("skip_ledger_check"):
            a, b, c = run_three(llm, point_at_neighbour)
        # the corrupted table went straight to the model: A attended B's page, nobody objected
        assert a.state is State.FINISHED
        assert llm.engine.ledger.violations["I2"] == 0
        bad = audit.violations_of(a.request_id)
        assert bad and {v.kind for v in bad} == {"read_foreign"} and bad[0].page_owner_request == b.owner.request
    else:
        a, b, c = run_three(llm, point_at_neighbour)
        assert a.state is State.ABORTED and a.abort_code == "isolation_violation" and "I2" in a.error
        assert audit.clean
    assert b.state is State.FINISHED and c.state is State.FINISHED


@pytest.mark.parametrize("on", [True, False], ids=["fault_on", "fault_off"])
def test_skip_watermark(make_llm, on):
    # The audit is the oracle here, not poisoned pages: with scrub=poison every request's
    # logits turn NaN today (masked-out poisoned slots still reach attention as 0 * NaN),
    # so NaN cannot tell a stale read from a clean one.
    llm = make_llm()
    llm.generate(["warm the pool up so freed pages hold stale data"] * 4, GREEDY)
    audit = audited(llm)
    if on:
        with faults.injected("skip_watermark"):
            a, _, _ = run_three(llm, claim_unwritten)
        # the never-written slots (an earlier request's bytes) were attended
        assert a.state is State.FINISHED
        bad = audit.violations_of(a.request_id)
        assert bad and {v.kind for v in bad} == {"read_unwritten"}
        assert llm.engine.ledger.violations["I3"] == 0
    else:
        a, _, _ = run_three(llm, claim_unwritten)
        assert a.state is State.ABORTED and "I3" in a.error
        assert audit.clean


def test_skip_watermark_leaves_the_ownership_check_on(make_llm):
    """Only the I3 part is skipped: a foreign page in the table is still refused (I2)."""
    llm = make_llm()
    audit = audited(llm)
    with faults.injected("skip_watermark"):
        a, b, c = run_three(llm, point_at_neighbour)
    assert a.state is State.ABORTED and "I2" in a.error and audit.clean


@pytest.mark.parametrize("on", [True, False], ids=["fault_on", "fault_off"])
def test_skip_node_admission(make_llm, on):
    llm = make_llm(max_model_len=64)
    eng = llm.engine
    audit = audited(llm)
    prompt = llm.tokenizer.encode("Tell me a long story about a lighthouse keeper. " * 4)[:56]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # 56 + 32 > 64
    before = eng.ledger.counters["pages_allocated"]
    if on:
        with faults.injected("skip_node_admission"):
            seq = eng.add_request(prompt, params, request_id="too-long")
            run_to_end(eng)
        # the over-length request got pages and ran through the model (I4 bypassed)
        assert eng.ledger.counters["pages_allocated"] > before
        assert len(audit.entries_of("too-long")) > 0
        assert seq.state is State.FINISHED and len(seq.output_ids) < 32  # cut short: it never fit
        assert faults.fired["skip_node_admission"] >= 1
    else:
        with pytest.raises(ContextLengthExceeded, match="maximum context length is 64"):
            eng.add_request(prompt, params, request_id="too-long")
        assert eng.ledger.counters["pages_allocated"] == before and audit.steps == 0
        assert not eng.has_unfinished()
