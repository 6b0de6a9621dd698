"""I2 and I3 with the real model: a request whose block table or watermark is wrong is
aborted before its forward pass, and nobody else notices.

Each test also runs the same fault with the check switched off and shows the fault then
does reach the model (the 'mutant'): the check is what stops it.
"""
from __future__ import annotations

import pytest
import torch

from kvfence.engine.request_states import State
from kvfence.kv.ledger import PageState

from .conftest import GREEDY, audited, claim_unwritten, point_at_neighbour, run_three, unwritten_slots


def clean_outputs(make_llm):
    return [s.output_ids for s in run_three(make_llm())]


@pytest.fixture(scope="module")
def baseline(make_llm):
    return clean_outputs(make_llm)


def stale_epoch(eng, seqs):
    seqs[0].table.epochs[0] -= 1


# At step 4 A's current page is its first, so a swapped first page is also a write
# target; by step 12 A has moved to its second page and only reads the first.
@pytest.mark.parametrize("fault,invariant,at_step", [
    (point_at_neighbour, "I2", 4), (point_at_neighbour, "I2", 12), (stale_epoch, "I2", 12),
    (unwritten_slots, "I3", 12)])
def test_fault_aborts_only_the_faulty_request(make_llm, baseline, fault, invariant, at_step):
    llm = make_llm()
    seqs = run_three(llm, fault, at_step)
    a, b, c = seqs
    assert a.state is State.ABORTED and a.finish_reason == "aborted" and a.abort_code == "isolation_violation"
    assert f"isolation check {invariant} failed" in a.error
    assert llm.engine.ledger.violations[invariant] == 1
    # the others go on untouched, token for token
    assert b.state is State.FINISHED and b.output_ids == baseline[1]
    assert c.state is State.FINISHED and c.output_ids == baseline[2]
    led = llm.engine.ledger
    assert led.num_owned == 0
    assert led.num_free + led.num_quarantined + led.num_shared == led.usable_pages
    led.check_consistency()


@pytest.mark.parametrize("path", ["float32 per-layer kernels", "bf16 torch"])
def test_the_checks_hold_on_the_other_compute_paths_too(loaded_fp32, loaded_bf16, path):
    """The tests here run the default (bf16: the one-call fused stack); --dtype float32 runs the
    per-layer fused kernels and fused_kernels=False the torch path: the same faults are stopped
    there too, and the others' tokens are that path's own."""
    from kvfence import LLM

    def make():
        if path == "bf16 torch":
            return LLM(dtype="bfloat16", loaded=loaded_bf16, kv_cache_memory="32MiB", clamp_context=True,
                       progress=False, fused_kernels=False)
        return LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="64MiB", clamp_context=True, progress=False)

    want = [s.output_ids for s in run_three(make())]
    for fault, invariant in ((point_at_neighbour, "I2"), (unwritten_slots, "I3")):
        llm = make()
        a, b, c = run_three(llm, fault, 12)
        assert a.abort_code == "isolation_violation" and f"isolation check {invariant} failed" in a.error
        assert [b.output_ids, c.output_ids] == want[1:] and llm.engine.ledger.num_owned == 0


def test_neighbour_page_is_quarantined_not_reused(make_llm):
    llm = make_llm()
    run_three(llm, point_at_neighbour, at_step=4)
    led = llm.engine.ledger
    assert led.num_quarantined == 1
    q = int((led.state == PageState.QUARANTINED).nonzero()[0][0])
    assert q not in led._free


def test_without_the_check_a_reads_b(make_llm, baseline):
    """Mutant: switch the check off and the same fault makes A attend B's page."""
    llm = make_llm(verify_reads=False)
    seqs = run_three(llm, point_at_neighbour, at_step=12)
    assert len(seqs[0].table) == 0 and seqs[0].num_computed > 16  # A was reading, not writing, page 0
    assert seqs[0].state is State.FINISHED  # nothing noticed...
    assert seqs[0].output_ids != baseline[0]  # ...yet A's answer was computed over B's KV
    assert llm.engine.ledger.violations["I3"] == llm.engine.ledger.violations["I2"] == 0


def test_without_the_check_unwritten_slots_are_read(make_llm):
    """Mutant for I3: with the check off, a request that claims 32 more computed tokens than
    it wrote attends those reserved-but-unwritten slots (the read audit, which looks at the
    batch the model actually runs, sees it); the watermark check is what prevents it."""
    llm = make_llm(verify_reads=False, scrub="none")
    llm.generate(["warm the pool up so freed pages hold stale data"] * 4, GREEDY)
    audit = audited(llm)
    run_three(llm, claim_unwritten, at_step=4)  # reused pages: earlier requests' KV
    assert audit.counters["violations:read_unwritten"] > 0


def test_poison_scrub_leaves_honest_requests_alone(make_llm):
    """Poison marks freed pages only: granted pages start clean, so requests under scrub
    poison produce finite logits and the same text as under zero."""
    prompts = ["warm the pool up", "so that freed pages are poisoned", "and then reused"] * 2
    zero = [o.text for o in make_llm(scrub="zero").generate(prompts, GREEDY)]
    llm = make_llm(scrub="poison")
    llm.generate(prompts, GREEDY)  # pages freed (poisoned), then granted again below
    nan_seen = []
    sampler = llm.engine.sampler

    def spy(logits, params, gens, histories=None):
        nan_seen.append(bool(torch.isnan(logits).any()))
        return sampler(logits, params, gens, histories)

    llm.engine.sampler = spy
    assert [o.text for o in llm.generate(prompts, GREEDY)] == zero
    assert nan_seen and not any(nan_seen)


def test_checks_on_catch_the_same_poisoned_read(make_llm):
    llm = make_llm(scrub="poison")
    llm.generate(["warm the pool up so freed pages are poisoned"] * 4, GREEDY)
    seqs = run_three(llm, claim_unwritten, at_step=4)
    assert seqs[0].state is State.ABORTED and "I3" in seqs[0].error
    assert all(s.state is State.FINISHED for s in seqs[1:])
