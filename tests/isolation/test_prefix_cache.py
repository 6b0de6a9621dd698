"""I9: the prefix cache reuses a tenant's own prefixes and never another tenant's."""
from __future__ import annotations

import pytest

from kvfence import SamplingParams
from kvfence.engine.request_states import State
from kvfence.kv import prefix_cache
from kvfence.kv.ledger import PageState, scope_name

from .conftest import BF16_PAGE, run_to_end

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SYSTEM = ("You are the support assistant of a bank. Never reveal account numbers. Answer briefly and "
          "politely, in plain English, and ask for clarification when a question is ambiguous. ") * 3


def run(eng, prompt_ids, tenant, **kw):
    seq = eng.add_request(prompt_ids, GREEDY, tenant=tenant, **kw)
    run_to_end(eng)
    return seq


@pytest.fixture
def llm(make_llm):
    return make_llm()


def ids_for(llm, question):
    return llm.tokenizer.encode(SYSTEM + question)


def shared_pages(eng) -> list[int]:
    return [p for p in range(1, eng.ledger.num_pages) if eng.ledger.state[p] == PageState.SHARED]


def point_and_run(eng, seq, slot: int, page: int) -> None:
    """Forge seq's block table: slot `slot` points at `page` (with its current epoch, so only
    the ownership check can catch it); then run everything to the end."""
    seq.table.pages[slot] = page
    seq.table.epochs[slot] = int(eng.ledger.epoch[page])
    run_to_end(eng)


def test_same_tenant_hits_and_output_is_unchanged(llm, make_llm):
    eng = llm.engine
    first = run(eng, ids_for(llm, "What are your opening hours?"), "A")
    second = run(eng, ids_for(llm, "How do I reset my PIN?"), "A")
    assert first.cached_tokens == 0
    shared_prefix = len(SYSTEM) and len(ids_for(llm, "")) - 1
    assert second.cached_tokens >= (shared_prefix // 16 - 1) * 16 > 0
    assert eng.ledger.num_shared > 0
    uncached = make_llm(enable_prefix_cache=False).engine
    ref = run(uncached, ids_for(llm, "How do I reset my PIN?"), "A")
    assert second.output_ids == ref.output_ids


def test_other_tenant_never_hits(llm):
    eng = llm.engine
    run(eng, ids_for(llm, "What are your opening hours?"), "A")
    b = run(eng, ids_for(llm, "What are your opening hours?"), "B")
    assert b.cached_tokens == 0
    a_again = run(eng, ids_for(llm, "What are your opening hours?"), "A")
    assert a_again.cached_tokens > 0


def test_public_scope_is_shared_only_by_those_who_opt_in(llm):
    eng = llm.engine
    run(eng, ids_for(llm, "Hi"), "A", public_prefix_scope="bank-system-prompt")
    b = run(eng, ids_for(llm, "Hello"), "B", public_prefix_scope="bank-system-prompt")
    c = run(eng, ids_for(llm, "Hello"), "C")
    assert b.cached_tokens > 0 and c.cached_tokens == 0


def test_scope_dropped_from_the_key_is_still_stopped_by_the_ledger(llm, monkeypatch):
    """Defense in depth: even if the cache key lost the scope, the ledger refuses to attach
    a shared page of another scope."""
    real = prefix_cache.page_hashes
    monkeypatch.setattr(prefix_cache, "page_hashes", lambda scope, *a: real("same-for-all", *a))
    eng = llm.engine
    run(eng, ids_for(llm, "What are your opening hours?"), "A")
    b = run(eng, ids_for(llm, "What are your opening hours?"), "B")
    assert b.cached_tokens == 0


def test_mutant_with_both_layers_removed_leaks(llm, monkeypatch):
    """Remove the scope from the key and from the ledger's check: B now reuses A's KV.
    This is what test_other_tenant_never_hits exists to catch."""
    from kvfence.kv.ledger import Owner

    real = prefix_cache.page_hashes
    monkeypatch.setattr(prefix_cache, "page_hashes", lambda scope, *a: real("same-for-all", *a))
    monkeypatch.setattr(Owner, "cache_scope", property(lambda self: 0))
    eng = llm.engine
    run(eng, ids_for(llm, "What are your opening hours?"), "A")
    b = run(eng, ids_for(llm, "What are your opening hours?"), "B")
    assert b.cached_tokens > 0


def test_forced_cross_tenant_read_of_a_shared_page_is_an_I2_violation(llm):
    eng = llm.engine
    run(eng, ids_for(llm, "What are your opening hours?"), "A")
    shared = shared_pages(eng)
    b = eng.add_request(llm.tokenizer.encode("Tenant B's own question, rather long to span pages " * 3),
                        GREEDY, tenant="B")
    eng.step()
    eng.step()
    point_and_run(eng, b, 0, shared[0])
    assert b.state is State.ABORTED and "I2" in b.error
    assert eng.ledger.state[shared[0]] == PageState.QUARANTINED  # no longer served to anyone


def test_writing_into_a_shared_page_is_refused(llm):
    eng = llm.engine
    a = run(eng, ids_for(llm, "What are your opening hours?"), "A")
    shared = shared_pages(eng)
    a2 = eng.add_request(ids_for(llm, "Where is the nearest branch?"), GREEDY, tenant="A")
    eng.step()
    eng.step()
    point_and_run(eng, a2, a2.num_computed // 16, shared[-1])   # the page the next token goes to
    assert a2.state is State.ABORTED and "would write" in a2.error
    assert a.state is State.FINISHED


def test_eviction_under_pressure_keeps_outputs_and_ledger_right(make_llm):
    llm = make_llm(kv_cache_memory=40 * BF16_PAGE)  # 39 usable pages
    eng = llm.engine
    ref_eng = make_llm(kv_cache_memory=40 * BF16_PAGE, enable_prefix_cache=False).engine
    for i in range(8):
        prompt = llm.tokenizer.encode(f"Document {i}: " + "lorem ipsum dolor sit amet " * 12)
        got = run(eng, prompt, f"T{i % 3}")
        want = run(ref_eng, prompt, f"T{i % 3}")
        assert got.output_ids == want.output_ids
        eng.ledger.check_consistency()
    assert eng.ledger.counters["pages_evicted"] > 0
    assert eng.ledger.num_owned == 0
    assert eng.ledger.num_available == eng.ledger.usable_pages


def test_a_busy_tenant_does_not_flush_another_tenants_cached_prefix(make_llm):
    """The pool fills with a busy tenant's cached prompts; a light tenant's system prompt,
    cached before them, is still a hit (global LRU evicted it first)."""
    llm = make_llm(kv_cache_memory=40 * BF16_PAGE)  # 39 usable pages
    eng = llm.engine
    run(eng, ids_for(llm, "Q: hello"), "light")
    for i in range(8):
        run(eng, llm.tokenizer.encode(f"Document {i}: " + "lorem ipsum dolor sit amet " * 12), "busy")
    assert eng.ledger.counters["pages_evicted"] > 0
    again = run(eng, ids_for(llm, "Q: goodbye"), "light")
    assert again.cached_tokens >= len(llm.tokenizer.encode(SYSTEM)) // 16 * 16 - 16
    eng.ledger.check_consistency()


@pytest.mark.parametrize("router", [None, "router-1"])
def test_a_public_scope_shares_prompts_not_what_the_model_wrote(llm, router):
    """The opt-in shares prompt prefixes. A's generated pages stay out of the public scope: B
    sending A's prompt and A's answer (a guess of it) attaches A's prompt pages only, so its
    cached_tokens cannot confirm the guess. In A's own scope the answer's pages are cached.
    The same on a PD node, where the scope is the router's copy (its key keeps the public mark)."""
    eng = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = ids_for(llm, "Hi")
    a = eng.add_request(prompt, long, tenant="A", public_prefix_scope="bank-system-prompt", router=router)
    run_to_end(eng)
    guess = prompt + a.output_ids + ids_for(llm, "")[:4]
    b = run(eng, guess, "B", public_prefix_scope="bank-system-prompt", router=router)
    assert 0 < b.cached_tokens <= len(prompt) // 16 * 16
    own = eng.add_request(prompt, long, tenant="A")
    run_to_end(eng)
    mine = run(eng, prompt + own.output_ids + ids_for(llm, "")[:4], "A")
    assert mine.cached_tokens > len(prompt)


def test_a_tenant_name_behind_two_routers_is_two_scopes(llm):
    """On a PD node a tenant's scope is the sending router's: another router, or the same one
    restarted (a new process id that forgets its reloads), may have given the name to another
    party, and that party must attach none of the pages cached under it (the gap a router
    restarted after a reload that missed the node left). Retiring one router's scope leaves
    the other's; reports still name the tenant, not the router."""
    eng = llm.engine
    question = ids_for(llm, "What are your opening hours?")
    run(eng, question, "A", router="router-1")
    assert run(eng, question, "A", router="router-1").cached_tokens > 0        # its own scope hits
    assert run(eng, question, "A", router="router-2").cached_tokens == 0       # another router's: nothing
    assert run(eng, question, "A").cached_tokens == 0                          # nor a single node's
    assert run(eng, question, "A", public_prefix_scope="p", router="router-1").cached_tokens == 0
    assert eng.forget_tenant("A", router="router-2") > 0
    assert run(eng, question, "A", router="router-1").cached_tokens > 0
    assert run(eng, question, "A", router="router-2").cached_tokens == 0
    assert set(eng.ledger.pages_by_owner()["shared"]) == {"A", "public:p"}


def test_a_forced_read_across_two_routers_tenants_of_one_name_is_reported_cross_tenant(llm, tmp_path):
    """The incident log names tenants, not routers, so router-1's "A" reading a page cached
    for router-2's "A" (perhaps another party) must not read as A touching its own data: the
    record says other_party, and the disclosure report counts it cross-tenant (found in
    review). Mutant: same_name_other_party always False."""
    from kvfence import disclosure, incidents

    incidents.open_log(tmp_path / "incidents.jsonl", "test")
    try:
        eng = llm.engine
        run(eng, ids_for(llm, "What are your opening hours?"), "A", router="router-2")
        shared = shared_pages(eng)
        a = eng.add_request(llm.tokenizer.encode("Another question of A's, rather long to span pages " * 3),
                            GREEDY, tenant="A", router="router-1")
        eng.step()
        eng.step()
        point_and_run(eng, a, 0, shared[0])
        assert a.state is State.ABORTED and "I2" in a.error
        # a page a running request of the other router's "A" owns: the same
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        x = eng.add_request(ids_for(llm, "Tell me about savings accounts."), long, tenant="A", router="router-2")
        y = eng.add_request(ids_for(llm, "Tell me about loans."), long, tenant="A", router="router-1")
        eng.step()
        eng.step()
        owned = x.table.pages[-1]   # its first pages are cached ones (the same system prompt)
        assert eng.ledger.state[owned] == PageState.OWNED
        point_and_run(eng, y, -1, owned)
        assert y.state is State.ABORTED and "I2" in y.error
    finally:
        incidents.close_log()
    rec = [r for r in incidents.read(tmp_path / "incidents.jsonl") if r["kind"] == "ledger_refusal"]
    assert [(r["request_id"], r["tenant"], r["involved_tenants"], r.get("other_party")) for r in rec] == [
        (a.request_id, "A", ["A"], True), (y.request_id, "A", ["A"], True)]
    rep = disclosure.build([tmp_path / "incidents.jsonl"])
    assert [c["data_of"] for c in rep["cross_tenant"]] == [["A"], ["A"]]
    assert rep["tenants"]["A"]["cross_tenant_events"] == 2
    assert "another party under the same name" in disclosure.render(rep)


def test_a_router_process_silent_past_its_idle_time_leaves_no_pages_or_names_behind(llm):
    """A restarted router is a new process id: its predecessor's scopes can no longer be
    attached, but their pages (a removed party's prompts among them) and their ledger names
    stayed until the cache happened to evict them. After RouterRealms.idle_s without a request
    or message from a router, its scopes are retired and their names forgotten; a router
    heard from since keeps its own, and a request still running keeps its name. Mutants: no
    sweep in step(); prune_names dropping what a running request uses."""
    eng = llm.engine
    now = [1000.0]
    eng.clock = lambda: now[0] + 5e8          # leases' wall clock: not what idleness is measured on
    eng.steady_clock = lambda: now[0]
    eng.realms.idle_s = 60.0
    question = ids_for(llm, "What are your opening hours?")
    run(eng, question, "A", router="gone-router")
    run(eng, question, "B", router="gone-router", public_prefix_scope="p")
    gone_a = eng.ledger.tenant_id(scope_name("A", router="gone-router"))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # admitted, still waiting (no page yet) when the sweep comes: only the request refers to its id
    running = eng.add_request(ids_for(llm, "Tell me about loans."), long, tenant="C", router="gone-router")
    now[0] = 1050.0
    eng.add_request(question, GREEDY, tenant="A", router="live-router")
    assert eng.next_timer() == 5e8 + 1000.0 + 60   # when gone-router becomes idle, as a wall time
    now[0] = 1070.0
    eng.step()                                     # gone-router: silent for 70 s; live-router for 20 s
    assert eng.ledger.tenant_name(running.owner.tenant) == "C"      # still running: its name is kept
    assert gone_a not in eng.ledger._names                          # nothing refers to it: forgotten
    run_to_end(eng)
    assert running.state is State.FINISHED
    assert set(eng.ledger.pages_by_owner()["shared"]) == {"A"}      # live-router's A alone
    assert run(eng, question, "A", router="live-router").cached_tokens > 0
    assert run(eng, question, "A", router="gone-router").cached_tokens == 0
    eng.ledger.check_consistency()
