"""The read audit (kvfence/kv/audit.py): the strong oracle, independent of Ledger.authorize.

It must see nothing wrong in a clean mixed workload (prefix-cache hits, chunked prefill,
preemption, several tenants), and it must see every foreign or unwritten read and every
foreign write that actually reaches the model: with the ledger check switched off, and
even when the block tables are right but the batch the model gets is not.
"""
from __future__ import annotations

import pytest

from kvfence import SamplingParams
from kvfence.engine.request_states import State
from kvfence.kv.audit import ReadAudit
from kvfence.kv.ledger import LedgerError, PageState

from .conftest import BF16_PAGE, audited, point_at_neighbour, run_three, run_to_end, unwritten_slots


def test_runner_takes_the_audit_from_its_constructor(make_llm):
    from kvfence.engine.runner import ModelRunner

    eng = make_llm().engine
    assert eng.runner.audit is None  # off by default
    r = ModelRunner(eng.model, eng.pool, eng.ledger, audit=True)
    assert isinstance(r.audit, ReadAudit) and r.audit.ledger is eng.ledger
    mine = ReadAudit(eng.ledger)
    assert ModelRunner(eng.model, eng.pool, eng.ledger, audit=mine).audit is mine


def test_clean_mixed_workload_has_no_audit_violation(make_llm):
    # 13 usable pages (208 tokens) and a 48-token step budget: chunked prefill and preemption
    llm = make_llm(kv_cache_memory=14 * BF16_PAGE, max_num_batched_tokens=48)
    audit = audited(llm)
    eng = llm.engine
    shared_prefix = "You are a careful assistant. Answer briefly and politely. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for t in ("A", "B"):  # publish a prefix per tenant
        llm.generate([shared_prefix + "First question?"], params, tenant=t)
    seqs = []
    for i in range(6):
        t = "AB"[i % 2]
        seqs.append(eng.add_request(llm.tokenizer.encode(shared_prefix + f"Question number {i}?"), params,
                                    tenant=t))
    run_to_end(eng)
    assert all(s.state is State.FINISHED for s in seqs)
    assert eng.scheduler.num_preemptions > 0, "the workload must exercise preemption"
    assert sum(s.cached_tokens for s in seqs) > 0, "the workload must exercise the prefix cache"
    assert audit.clean, [v.describe() for v in audit.violations[:5]]
    c = audit.counters
    assert c["slots_read"] > 0 and c["slots_written"] > 0 and c["steps"] == audit.steps > 10
    # the log names real pages, with the epoch the ledger had for them
    rec = audit.log[-1]
    assert len(rec.entries) and set(rec.entries["request"]) <= set(rec.request_ids)
    assert (rec.entries["first"] <= rec.entries["last"]).all()


def test_audit_sees_reads_of_shared_prefix_pages(make_llm):
    llm = make_llm()
    audit = audited(llm)
    prefix = "Shared instructions for every question in this test. " * 4
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([prefix + "one"], p, tenant="A")
    audit.clear()
    seq = llm.engine.add_request(llm.tokenizer.encode(prefix + "two"), p, tenant="A", request_id="second")
    llm.engine.step()  # scheduling attaches the cached prefix pages
    shared = [pg for pg in seq.table.pages if llm.engine.ledger.state[pg] == PageState.SHARED]
    run_to_end(llm.engine)
    assert seq.cached_tokens > 0 and shared
    read = set(audit.entries_of("second")[["page", "write"]].tolist())
    assert {(pg, False) for pg in shared} <= read  # attended, never written
    assert audit.clean


def test_checks_on_the_audit_sees_nothing(make_llm):
    llm = make_llm()
    audit = audited(llm)
    a, b, c = run_three(llm, point_at_neighbour)
    assert a.state is State.ABORTED and "I2" in a.error  # stopped before its pass ran
    assert audit.clean


def test_with_checks_off_the_audit_catches_the_foreign_read(make_llm):
    llm = make_llm(verify_reads=False)
    audit = audited(llm)
    a, b, _ = run_three(llm, point_at_neighbour)
    assert a.state is State.FINISHED  # nothing else noticed
    mine = audit.violations_of(a.request_id)
    assert mine and all(v.kind == "read_foreign" for v in mine)
    v = mine[0]
    assert v.page_owner_request == b.owner.request and v.page_state == "owned"
    assert v.first_slot == 0 and v.last_slot == llm.engine.ledger.page_size - 1
    assert not audit.violations_of(b.request_id)
    assert audit.counters["violations:read_foreign"] == len(mine)


def test_with_checks_off_the_audit_catches_a_foreign_write(make_llm):
    """At step 4 A's first page is also the one it writes: the swapped-in page is written
    into (the ledger's mark_written refuses afterwards, too late: the model already wrote)."""
    llm = make_llm(verify_reads=False)
    audit = audited(llm)
    with pytest.raises(LedgerError, match="wrote page"):
        run_three(llm, point_at_neighbour, at_step=4)
    kinds = {v.kind for v in audit.violations}
    assert "write_foreign" in kinds and "read_foreign" in kinds
    assert len({v.request for v in audit.violations}) == 1


def test_with_checks_off_the_audit_catches_unwritten_reads(make_llm):
    llm = make_llm(verify_reads=False)
    audit = audited(llm)
    a, _, _ = run_three(llm, unwritten_slots)
    mine = audit.violations_of(a.request_id)
    assert {v.kind for v in mine} == {"read_unwritten"}
    assert audit.counters["violations:read_foreign"] == 0


def test_audit_checks_the_batch_not_the_block_tables(make_llm):
    """The block tables are right and the ledger check passes, but the batch handed to the
    model names a neighbour's page: the audit looks at what the model reads, and sees it."""
    llm = make_llm()
    audit = audited(llm)
    eng = llm.engine
    runner = eng.runner
    build = runner._build
    state = {"armed": False, "done": False}

    def tampered(step):
        batch, sampled, prompt_rows = build(step)
        if state["armed"] and not state["done"]:
            if batch.attn.pages.shape[0] >= 2:
                batch.attn.pages[0, 0] = batch.attn.pages[1, 0]
                state["done"] = True
        return batch, sampled, prompt_rows

    runner._build = tampered
    seqs = run_three(llm, lambda e, s: state.update(armed=True), at_step=12)
    assert state["done"]
    assert eng.ledger.violations["I2"] == 0 and all(s.state is State.FINISHED for s in seqs)
    bad = [v for v in audit.violations if v.kind == "read_foreign"]
    assert len(bad) == 1 and bad[0].page_state == "owned"


def test_log_is_bounded(make_llm):
    llm = make_llm()
    audit = audited(llm, log_steps=3)
    llm.generate(["a short prompt"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert audit.steps >= 8 and len(audit.log) == 3
    assert [r.step for r in audit.log] == list(range(audit.steps - 3, audit.steps))


@pytest.mark.parametrize("log_steps", [0])
def test_log_can_be_off(make_llm, log_steps):
    llm = make_llm()
    audit = audited(llm, log_steps=log_steps)
    llm.generate(["a short prompt"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert audit.steps == 4 and not audit.log and audit.clean
