"""I9 for n > 1 choices: the choices of one request share the prompt's full KV pages read-only.

The server (server/app.py, _Choice) admits every choice at once, the others naming the first
(`after`); the scheduler starts them once the first has computed the prompt and published its
full pages to the tenant's prefix cache; they attach those pages and compute only the
prompt's partial last page, each into a page of its own. This drives the engine the same way,
with the real model, and checks
in the ledger that the pages are SHARED, reference-counted once per choice and written by
none of them; that a choice pointed at a shared prompt page for its next write is refused by
the per-pass check (I2, "would write") before the model runs, with the other choices' output
and the page's bytes unchanged; and, with the check's read-only term removed (the
`write_shared_page` fault), that the same write lands in the page the other choices read.
"""
from __future__ import annotations

import pytest

from kvfence import SamplingParams, faults
from kvfence.engine.request_states import State
from kvfence.kv.ledger import LedgerError, PageState, ReadRequest

from .conftest import run_to_end

PROMPT = ("A short history of printing: movable type appeared in East Asia, and centuries later the press "
          "spread across Europe, where it changed how books were made and read. Printers set each page by hand, "
          "letter by letter, and a good workshop could print a few hundred sheets a day.")
N = 3


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)


@pytest.fixture
def llm(make_llm):
    return make_llm()


def start_choices(eng, ids):
    """All admitted together; the lead runs its prefill (and samples its first token), the
    others start after it."""
    lead = eng.add_request(ids, params(100), tenant="A")
    others = [eng.add_request(ids, params(100 + j), tenant="A", after=lead.request_id) for j in range(1, N)]
    for _ in range(100):
        if not any(s.state is State.WAITING for s in others):
            break
        eng.step()   # they attach the cached pages and compute the partial page
    assert not any(s.state is State.WAITING for s in others), "the other choices never started"
    return [lead, *others]


def test_choices_hold_the_prompts_full_pages_read_only_and_the_partial_page_each_its_own(llm):
    eng, led = llm.engine, llm.engine.ledger
    ids = llm.tokenizer.encode(PROMPT)
    ps = led.page_size
    full = (len(ids) - 1) // ps
    assert full >= 2 and len(ids) % ps != 0      # full pages to share and a partial last page
    lead, *others = choices = start_choices(eng, ids)
    shared = lead.table.pages[:full]
    for s in others:
        assert s.cached_tokens == full * ps
        assert s.table.pages[:full] == shared and s.table.epochs[:full] == lead.table.epochs[:full]
    for p in shared:
        assert led.state[p] == PageState.SHARED and led.refcount[p] == N   # the lead's reference and one each
        assert led.owner_request[p] == -1 and led.written[p] == ps         # nobody's to write, fully written
    # the partial last page: one per choice, owned by that choice alone
    partial = [s.table.pages[full] for s in choices]
    assert len(set(partial)) == N
    for s, p in zip(choices, partial):
        assert led.state[p] == PageState.OWNED and led.owner_request[p] == s.owner.request
    led.check_consistency()
    # the ledger's two refusals of a write into a shared page: the per-pass check, and the record of a write
    s = others[0]
    bad = led.authorize([ReadRequest(s.owner, s.table, 0, full * ps)])   # recompute from 0 over the shared pages
    assert len(bad) == 1 and bad[0].invariant == "I2" and bad[0].page == shared[0] and "would write" in bad[0].detail
    with pytest.raises(LedgerError):
        led.mark_written(s.owner, s.table, 0, ps)
    run_to_end(eng)
    assert all(c.state is State.FINISHED for c in choices)
    assert all(led.refcount[p] == 0 and led.state[p] == PageState.SHARED for p in shared)  # cached, evictable
    led.check_consistency()


def write_into_shared_prompt_page(llm):
    """Choice 1's next token is pointed at the last shared prompt page (its own partial
    page swapped for it in its block table): the bug of a choice writing where the others read."""
    eng, led, pool = llm.engine, llm.engine.ledger, llm.engine.pool
    ids = llm.tokenizer.encode(PROMPT)
    full = (len(ids) - 1) // led.page_size
    choices = start_choices(eng, ids)
    target = choices[0].table.pages[full - 1]
    before = pool.read_pages([target]).clone()
    s = choices[1]
    at = s.num_computed // led.page_size      # the page its next token's K/V go to
    s.table.pages[at], s.table.epochs[at] = target, int(led.epoch[target])
    return choices, target, before


def test_a_choice_writing_into_a_shared_prompt_page_is_refused(llm, make_llm):
    ref_engine = make_llm().engine            # the same choices without the fault
    ref = start_choices(ref_engine, llm.tokenizer.encode(PROMPT))
    run_to_end(ref_engine)

    choices, target, before = write_into_shared_prompt_page(llm)
    eng, led = llm.engine, llm.engine.ledger
    run_to_end(eng)
    lead, bad, other = choices
    assert bad.state is State.ABORTED and "I2" in bad.error and "would write" in bad.error
    assert bad.abort_code == "isolation_violation"
    assert llm.engine.pool.read_pages([target]).equal(before)        # the shared page's bytes are untouched
    # the choices that read it went on and got what they get without the fault
    assert lead.state is other.state is State.FINISHED
    assert lead.output_ids == ref[0].output_ids and other.output_ids == ref[2].output_ids
    assert led.state[target] == PageState.QUARANTINED                # the page the bad write pointed at
    led.check_consistency()


def test_mutant_without_the_read_only_check_writes_into_the_page_the_others_read(llm):
    """With the per-pass check's read-only term removed, the write reaches the model and the
    pool: the shared prompt page changes under the choices that read it. The ledger's record
    of the write then refuses (LedgerError stops the engine), too late: this is what
    test_a_choice_writing_into_a_shared_prompt_page_is_refused exists to catch."""
    with faults.injected("write_shared_page"):
        choices, target, before = write_into_shared_prompt_page(llm)
        with pytest.raises(LedgerError, match="does not own"):
            run_to_end(llm.engine)
    assert choices[1].state is not State.ABORTED
    assert not llm.engine.pool.read_pages([target]).equal(before)
