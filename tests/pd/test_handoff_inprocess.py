"""The PD handoff on two engines in one process (in-process transport): the same protocol
code as the real nodes, fast enough to cover its failure paths one by one."""
from __future__ import annotations

import time

import pytest

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.params import SamplingParams
from kvfence.pd.decode import KvImporter
from kvfence.pd.manifest import ManifestError
from kvfence.pd.messages import Manifest
from kvfence.pd.prefill import KvExporter
from kvfence.pd.seal import key_id
from kvfence.pd.settings import PDSettings
from kvfence.pd.transfer import InProcessTransport

GREEDY = dict(temperature=0.0, ignore_eos=True)
SECRET = b"in-process test cluster secret, 32+ bytes long"


def engine(loaded, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("clamp_context", True)
    kw.setdefault("max_model_len", 1024)
    return LLMEngine(EngineConfig(dtype="bfloat16", progress=False, **kw), loaded)


class Pair:
    def __init__(self, loaded, prefill_kw=None, decode_kw=None, **settings):
        self.p = engine(loaded, **(prefill_kw or {}))
        self.d = engine(loaded, enable_prefix_cache=False, **(decode_kw or {}))
        settings.setdefault("cluster_secret", SECRET)
        self.exp = KvExporter(self.p, PDSettings("prefill", **settings), InProcessTransport())
        self.imp = KvImporter(self.d, PDSettings("decode", **settings), InProcessTransport())

    def handoff(self, manifest: dict) -> dict:
        """What the router sends decode: the manifest and the source it read from prefill."""
        source = {"session": self.exp.transport.session_id, "base": self.exp.base, "boot_id": self.exp.boot_id}
        return {"manifest": manifest, "source": source}

    def prefill(self, ids, params, rid, tenant="t1") -> dict:
        self.p.add_request(ids, params, tenant=tenant, request_id=rid, hold_kv=True)
        for _ in range(200):
            for out in self.p.step():
                if out.seq.request_id == rid and out.finished:
                    assert out.event == "kv_held", out.seq.error
                    return out.data
        raise AssertionError("prefill never finished")

    def decode(self, ids, params, rid, manifest, tenant="t1", steps=2000):
        seq = self.d.add_request(ids, params, tenant=tenant, request_id=rid, kv_source=self.handoff(manifest))
        events = []
        for _ in range(steps):
            for out in self.d.step():
                if out.seq is seq and out.event:
                    events.append(out.event)
            if seq.finished:
                return seq, events
            time.sleep(0.001)
        raise AssertionError(f"decode never finished: {seq.state}")


def single(loaded, ids, params):
    e = engine(loaded)
    seq = e.add_request(ids, params)
    while e.has_unfinished():
        e.step()
    return seq.output_ids


@pytest.fixture(scope="module")
def pair(loaded_bf16):
    return Pair(loaded_bf16)


def prompt(n, seed=0):
    import random
    r = random.Random(seed)
    return [r.randrange(100, 40000) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 17, 100])
def test_handoff_matches_single_node(loaded_bf16, pair, n):
    ids, params = prompt(n, n), SamplingParams(max_tokens=8, **GREEDY)
    m = pair.prefill(ids, params, f"r{n}")
    assert m["token_count"] == n - 1 and m["page_count"] == -(-(n - 1) // 16)
    seq, events = pair.decode(ids, params, f"r{n}", m)
    assert events[0] == "kv_verified" and seq.finish_reason == "length"
    assert seq.output_ids == single(loaded_bf16, ids, params)
    assert pair.p.release_kv(f"r{n}") == "released"
    assert pair.exp.staging.ledger.num_owned == 0 and pair.imp.staging.ledger.num_owned == 0
    assert pair.d.ledger.num_owned == 0


def test_manifest_for_another_request_is_refused_before_reserving(pair):
    ids, params = prompt(40, 1), SamplingParams(max_tokens=4, **GREEDY)
    m = pair.prefill(ids, params, "a1")
    before = pair.d.ledger.counters["pages_allocated"]
    with pytest.raises(ManifestError, match="is for request"):
        pair.decode(ids, params, "a2", m)
    wrong_len = prompt(41, 1)
    with pytest.raises(ManifestError, match="tokens"):
        pair.decode(wrong_len, params, "a1", m)
    assert pair.d.ledger.counters["pages_allocated"] == before
    pair.p.abort_kv("a1", reader_stopped=True, reason="test")


def test_corrupted_page_fails_verification_and_frees_everything(pair):
    ids, params = prompt(50, 2), SamplingParams(max_tokens=4, **GREEDY)
    m = pair.prefill(ids, params, "c1")
    pair.exp.staging.buf[m["slots"][1], 100] ^= 0xFF  # one byte flipped on the wire
    seq, events = pair.decode(ids, params, "c1", m)
    assert seq.abort_code == "kv_verification_failed" and "authentication failed" in seq.error
    assert events == ["kv_failed"] and seq.output_ids == []
    assert pair.d.ledger.num_owned == 0 and pair.imp.staging.ledger.num_owned == 0
    pair.p.abort_kv("c1", reader_stopped=True, reason="decode failed")
    assert pair.exp.staging.ledger.num_owned == 0 and pair.exp.staging.ledger.num_quarantined == 0


def test_skip_row_auth_fault_lets_the_corruption_through(pair):
    """The mutant for the rows' authentication (I5, I10): with the tag unchecked the flipped
    byte is decrypted and decoded."""
    ids, params = prompt(50, 3), SamplingParams(max_tokens=4, **GREEDY)
    m = pair.prefill(ids, params, "k1")
    pair.exp.staging.buf[m["slots"][0], 200] ^= 0xFF
    with faults.injected("skip_row_auth"):
        seq, _ = pair.decode(ids, params, "k1", m)
    assert seq.finish_reason == "length"
    pair.p.release_kv("k1")


def test_reused_rows_fail_authentication(pair):
    """A handle whose rows now hold another request's KV (a lease bug): they are sealed under
    the other request's key and header, so they do not open, and nothing is decoded. With
    the authentication skipped (the mutant) the foreign rows decrypt to noise and reach the
    pool: the tag check is what stops them."""
    ids, params = prompt(30, 4), SamplingParams(max_tokens=4, **GREEDY)
    m1 = pair.prefill(ids, params, "h1")
    pair.p.abort_kv("h1", reader_stopped=True, reason="test: rows freed")
    m2 = pair.prefill(prompt(30, 5), params, "h2", tenant="t2")
    assert set(m2["slots"]) & set(m1["slots"])  # LIFO reuse: same rows
    seq, _ = pair.decode(ids, params, "h1", m1)
    assert seq.abort_code == "kv_verification_failed" and "authentication failed" in seq.error
    assert pair.d.ledger.num_owned == 0
    with faults.injected("skip_row_auth"):
        seq, _ = pair.decode(ids, params, "h1x", {**m1, "request_id": "h1x"})
    assert seq.finish_reason == "length"   # the mutant decoded over foreign bytes
    pair.p.release_kv("h2")


def test_rows_are_ciphertext_while_held_and_zero_once_released(pair):
    """I10 on both nodes' registered memory: a held row is not the page's plaintext, and a
    released row (prefill after the ACK, decode after unstaging) is all zeros."""
    ids, params = prompt(40, 11), SamplingParams(max_tokens=2, **GREEDY)
    m = pair.prefill(ids, params, "z1")
    man, st = Manifest.from_json(m), pair.exp.staging
    plain = st.open_rows(m["slots"], man, pair.exp.cipher(SECRET, man, pair.p.requests["z1"]))
    sealed = st.buf[m["slots"], :st.data_bytes]
    assert plain.any(dim=1).all()                       # the pages hold real KV ...
    assert (plain != sealed).float().mean() > 0.99      # ... and the registered rows do not show it
    seq, events = pair.decode(ids, params, "z1", m)
    assert events[0] == "kv_verified"
    assert not pair.imp.staging.buf.any()               # decode's rows zeroed after unstaging
    pair.p.release_kv("z1")
    assert not pair.exp.staging.buf.any()               # prefill's rows zeroed after the ACK


def test_handoff_from_another_prefill_boot_is_refused(loaded_bf16):
    """A restarted prefill (same cluster secret, new boot id) re-registers at the same
    address with the old rows still in memory: a manifest of the old boot with the new
    source is refused before anything is reserved; the old rows, read through a source that
    claims the old boot, do not open under the new process's identity either."""
    pr = Pair(loaded_bf16)
    ids, params = prompt(30, 12), SamplingParams(max_tokens=2, **GREEDY)
    m = pr.prefill(ids, params, "b1")
    old = pr.handoff(m)
    KvExporter(pr.p, PDSettings("prefill", cluster_secret=SECRET), pr.exp.transport)  # the new boot
    new_source = {**old["source"], "boot_id": pr.p.kv_link.boot_id}
    with pytest.raises(ManifestError, match="another prefill process"):
        pr.d.add_request(ids, params, request_id="b1", kv_source={"manifest": m, "source": new_source})
    assert pr.d.ledger.num_owned == 0


def test_lease_expiry_fences_rows_until_no_pull_can_run(loaded_bf16):
    pr = Pair(loaded_bf16, lease_s=2.5, clock_skew_s=0.5, max_pull_s=5, transfer_timeout_s=1)
    ids, params = prompt(40, 6), SamplingParams(max_tokens=4, **GREEDY)
    m = pr.prefill(ids, params, "l1")
    held = m["page_count"]
    time.sleep(2.6)
    pr.p.step()
    seq = pr.exp.staging.ledger
    assert pr.p.requests.get("l1") is None and seq.num_quarantined == held  # fenced, not freed
    # decode may no longer start the pull
    d, _ = pr.decode(ids, params, "l1", m)
    assert d.abort_code == "lease_expired" and pr.d.ledger.num_owned == 0
    fence = pr.exp.staging.ledger.next_fence_time()
    assert fence == pytest.approx(m["lease_deadline"] + 5 + 0.5)
    pr.exp.staging.ledger.lift_expired_fences(fence)
    assert seq.num_quarantined == 0


def test_duplicate_and_late_notices_touch_nothing_else(loaded_bf16):
    pr = Pair(loaded_bf16, pull_give_up_s=0.3)
    ids, params = prompt(40, 7), SamplingParams(max_tokens=3, **GREEDY)
    m = pr.prefill(ids, params, "d1")
    with faults.injected("duplicate_transfer_completion"):
        seq, _ = pr.decode(ids, params, "d1", m)
    assert seq.finish_reason == "length" and pr.imp.counters["stale_notices"] == 1
    pr.p.release_kv("d1")
    # a notice that arrives after decode gave up: the rows stay fenced until it comes
    m = pr.prefill(ids, params, "d2")
    with faults.injected(delay_transfer_completion=1.0):
        seq, _ = pr.decode(ids, params, "d2", m)
        assert seq.abort_code == "kv_transfer_timeout"
        assert pr.imp.staging.ledger.num_quarantined == m["page_count"]
        time.sleep(1.2)
        pr.d.step()
    assert pr.imp.counters["late_notices"] == 1 and pr.imp.staging.ledger.num_quarantined == 0
    assert pr.d.ledger.num_owned == 0
    pr.p.abort_kv("d2", reader_stopped=True, reason="decode gave up")


def test_free_on_abort_fault_releases_rows_under_a_running_pull(loaded_bf16):
    """Mutant for I6: with the fault the rows go back while the pull can still write them."""
    pr = Pair(loaded_bf16, pull_give_up_s=0.2)
    ids, params = prompt(40, 8), SamplingParams(max_tokens=3, **GREEDY)
    m = pr.prefill(ids, params, "f1")
    with faults.injected("free_on_abort_during_transfer", delay_transfer_completion=0.6):
        seq, _ = pr.decode(ids, params, "f1", m)
        assert seq.abort_code == "kv_transfer_timeout"
        assert pr.imp.staging.ledger.num_quarantined == 0  # freed under the in-flight pull
    time.sleep(0.7)
    pr.p.abort_kv("f1", reader_stopped=True, reason="x")


def test_prefill_rejects_over_length_and_nothing_is_allocated(pair):
    ids = prompt(1000, 9)
    before = pair.p.ledger.counters["pages_allocated"]
    with pytest.raises(ContextLengthExceeded):
        pair.p.add_request(ids, SamplingParams(max_tokens=100), request_id="o1", hold_kv=True)
    assert pair.p.ledger.counters["pages_allocated"] == before


def _queued_pull_scenario(loaded_bf16) -> list[str]:
    """One pull worker and a slow transport: B's pull waits behind A's, B gives up, then C
    takes rows. Returns every read that began writing rows its pull no longer owned."""
    pr = Pair(loaded_bf16, pull_give_up_s=0.3, max_pull_s=1.0, transfer_timeout_s=1)
    pr.imp._workers.shutdown(wait=True)
    from concurrent.futures import ThreadPoolExecutor
    pr.imp._workers = ThreadPoolExecutor(1)
    st, read, wrong = pr.imp.staging, pr.imp.transport.read, []

    def slow_read(session, local_addrs, remote_addrs, lengths):
        rows = [(a - st.base) // st.slot_bytes for a in local_addrs]
        mine = [p for p in list(pr.imp.pulls.values()) if list(p.rows.pages) == rows]
        owners = {int(st.ledger.owner_request[r]) for r in rows}
        if not mine or owners != {mine[0].owner.request}:
            wrong.append(f"a read began writing rows {rows} owned by {owners}")
        time.sleep(1.2)
        return read(session, local_addrs, remote_addrs, lengths)
    pr.imp.transport.read = slow_read
    params = SamplingParams(max_tokens=2, **GREEDY)
    ids = {k: prompt(20, 30 + i) for i, k in enumerate("abc")}
    ms = {k: pr.prefill(ids[k], params, f"q{k}") for k in "abc"}
    seqs = {k: pr.d.add_request(ids[k], params, tenant="t1", request_id=f"q{k}", kv_source=pr.handoff(ms[k]))
            for k in "ab"}
    end = time.monotonic() + 10
    while not seqs["b"].finished and time.monotonic() < end:   # B gives up while queued behind A
        pr.d.step()
        time.sleep(0.01)
    assert seqs["b"].abort_code == "kv_transfer_timeout"
    time.sleep(1.05)   # past B's queue time + max_pull: the old rule's fence has lifted by now
    pr.d.step()
    seqs["c"] = pr.d.add_request(ids["c"], params, tenant="t1", request_id="qc", kv_source=pr.handoff(ms["c"]))
    end = time.monotonic() + 20
    while not all(s.finished for s in seqs.values()) and time.monotonic() < end:
        pr.d.step()
        time.sleep(0.01)
    time.sleep(1.5)    # let a read of B that might still begin do so
    pr.d.step()
    return wrong


def test_a_queued_pull_given_up_never_begins_its_read(loaded_bf16):
    """I6 for queued pulls: B's rows go back at once because its read has not begun and never
    will; C, granted them, is written only by its own read. Mutant fence_pull_from_submit (the
    old rule: fenced from when B was queued): B's rows go at queue time + max_pull while its
    read has not begun, and that read later begins writing C's rows."""
    assert _queued_pull_scenario(loaded_bf16) == []
    with faults.injected("fence_pull_from_submit"):
        wrong = _queued_pull_scenario(loaded_bf16)
    assert wrong, "the mutant's late read should have hit rows owned by another request"


def test_decode_says_whether_a_read_can_still_run(loaded_bf16):
    """What /internal/stop_pull answers the router (which relays it to prefill as
    reader_stopped): a request still waiting for decode's pages has no read, so prefill may
    free its rows at once instead of fencing them; once a read's notice came, it has ended.
    (A read that began and has not reported counts as running: the queued-pull test above.)"""
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "20MiB"})
    params = SamplingParams(max_tokens=400, **GREEDY)
    ids_x, ids_y = prompt(300, 40), prompt(300, 41)
    mx, my = pr.prefill(ids_x, params, "sx"), pr.prefill(ids_y, params, "sy")
    x = pr.d.add_request(ids_x, params, tenant="t1", request_id="sx", kv_source=pr.handoff(mx))
    y = pr.d.add_request(ids_y, params, tenant="t1", request_id="sy", kv_source=pr.handoff(my))
    assert [s.request_id for s in pr.imp.waiting] == ["sy"]          # no pages for y while x holds them
    pr.d.abort("sy", "the router gave up")
    assert y.finished and pr.d.kv_link.reader_stopped("sy")          # y never read: prefill may free at once
    assert pr.p.abort_kv("sy", reader_stopped=True, reason="client gone") == "aborted"
    assert pr.exp.staging.ledger.num_quarantined == 0                # freed, not fenced
    assert not pr.d.kv_link.reader_stopped("sx")                     # x's read has not reported yet
    while not x.output_ids:                                           # verified: x decodes
        pr.d.step()
    assert pr.d.kv_link.reader_stopped("sx")                         # x's read ended with its notice
    pr.p.release_kv("sx")
    pr.d.abort("sx", "done")                                          # (the other 399 tokens prove nothing here)
    while not x.finished:
        pr.d.step()


def test_a_decode_request_that_arrives_after_the_router_gave_up_is_refused(loaded_bf16):
    """Found in review (I6): the router gives up while its /internal/decode is still on its way;
    stop_pull found no read of a request decode had not seen, answered reader_stopped, prefill
    freed the rows at once and granted them to the next request; then the late arrival was
    admitted and its pull read those rows (they would not open: another request's key). Now
    the id is refused once decode has said "stopped". Mutant: without the refusal (the
    `given_up` check), the late request is admitted and its pull reads g2's rows."""
    pr = Pair(loaded_bf16)
    ids, params = prompt(60, 50), SamplingParams(max_tokens=3, **GREEDY)
    m1 = pr.prefill(ids, params, "g1")
    assert pr.imp.stop_pull("g1")                                 # decode never saw g1: no read can run
    assert pr.p.abort_kv("g1", reader_stopped=True, reason="client gone") == "aborted"
    assert pr.exp.staging.ledger.num_quarantined == 0               # freed at once, on decode's word
    m2 = pr.prefill(prompt(60, 51), params, "g2")
    assert set(m2["slots"]) & set(m1["slots"])                       # g2 holds g1's old rows now
    with pytest.raises(ManifestError, match="gave up on it"):
        pr.decode(ids, params, "g1", m1)                            # the late arrival
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0
    seq, _ = pr.decode(prompt(60, 51), params, "g2", m2)            # g2's rows were never touched
    assert seq.finish_reason == "length"
    pr.p.release_kv("g2")


def test_a_stop_pull_decode_cannot_remember_leaves_the_rows_fenced(loaded_bf16, monkeypatch):
    """Past GIVEN_UP_MAX remembered ids decode cannot promise to refuse a late arrival: it
    answers "a read may run", and prefill fences instead of freeing."""
    from kvfence.pd import decode as decode_mod
    monkeypatch.setattr(decode_mod, "GIVEN_UP_MAX", 2)
    pr = Pair(loaded_bf16)
    assert pr.imp.stop_pull("x1") and pr.imp.stop_pull("x2") and pr.imp.stop_pull("x1")
    assert not pr.imp.stop_pull("x3") and pr.imp.counters["given_up_full"] == 1


def test_an_ack_after_the_lease_ended_lifts_the_fence(loaded_bf16):
    """Decode's pull may begin just before the lease's end and be verified after it: prefill
    has fenced the rows by then, and the ACK (or decode's "no read runs") that comes later is
    proof nothing reads them, so they go back at once, not at the fence's deadline ~80 s later
    with a false incident record (found in review)."""
    pr = Pair(loaded_bf16, lease_s=1.0, clock_skew_s=0.2, max_pull_s=60, transfer_timeout_s=1)
    params = SamplingParams(max_tokens=3, **GREEDY)
    for rid, word in (("k1", "ack"), ("k2", "stopped")):
        m = pr.prefill(prompt(40, 60), params, rid)
        time.sleep(1.1)
        pr.p.step()                                                   # the lease ends: fenced
        assert pr.exp.staging.ledger.num_quarantined == m["page_count"]
        if word == "ack":
            pr.p.release_kv(rid)
        else:
            pr.p.abort_kv(rid, reader_stopped=True, reason="decode: no read runs")
        assert pr.exp.staging.ledger.num_quarantined == 0 and pr.exp.staging.ledger.num_owned == 0
    assert pr.exp.counters["fences_lifted_by_word"] == 2
    pr.p.abort_kv("k3", reader_stopped=False, reason="unknown request")   # no word, no fence: nothing changes


POISON = 4242          # a token id only the poisoned prompts contain (prompt() draws from 100..40000 minus it)


def _poisoned(n, seed):
    ids = [t for t in prompt(n, seed) if t != POISON]
    ids[n // 3] = POISON
    return ids


def test_an_exception_in_prefill_staging_fails_only_that_request(loaded_bf16):
    """Fault point poison_link: staging one request's rows raises. That request ends alone
    (engine_error) with its rows and pages back; a request staged in the same step is held
    and hands off as usual. Without containment the exception leaves step() and stops the node."""
    pr = Pair(loaded_bf16)
    params = SamplingParams(max_tokens=4, **GREEDY)
    good, bad = prompt(40, 60), _poisoned(40, 61)
    pr.p.add_request(good, params, tenant="t1", request_id="g", hold_kv=True)
    pr.p.add_request(bad, params, tenant="t2", request_id="b", hold_kv=True)
    ended: dict[str, object] = {}
    with faults.injected(poison_link=str(POISON)):
        for _ in range(50):
            for out in pr.p.step():
                if out.finished:
                    ended[out.seq.request_id] = out
            if len(ended) == 2:
                break
    assert ended["b"].seq.abort_code == "engine_error" and ended["b"].event is None
    assert ended["g"].event == "kv_held"
    assert pr.exp.staging.ledger.num_owned == pr.p.ledger.pages_for(39)     # only g's rows
    assert pr.exp.staging.ledger.num_quarantined == 0
    seq, _ = pr.decode(good, params, "g", ended["g"].data)
    assert seq.output_ids == single(loaded_bf16, good, params)
    pr.p.release_kv("g")
    assert pr.exp.staging.ledger.num_owned == 0 and pr.p.ledger.num_owned == 0


def test_an_exception_while_decode_opens_rows_fails_only_that_request(loaded_bf16):
    """poison_link on decode: opening one pulled request's rows raises after its read ended.
    It fails alone (engine_error) with its rows freed at once (the read is over) and its pool
    pages back; another request pulled in the same step runs to the single-node output."""
    pr = Pair(loaded_bf16)
    params = SamplingParams(max_tokens=6, **GREEDY)
    good, bad = prompt(50, 62), _poisoned(50, 63)
    mg, mb = pr.prefill(good, params, "g"), pr.prefill(bad, params, "b", tenant="t2")
    with faults.injected(poison_link=str(POISON)):
        g = pr.d.add_request(good, params, tenant="t1", request_id="g", kv_source=pr.handoff(mg))
        b = pr.d.add_request(bad, params, tenant="t2", request_id="b", kv_source=pr.handoff(mb))
        end = time.monotonic() + 30
        while not (g.finished and b.finished) and time.monotonic() < end:
            pr.d.step()
            time.sleep(0.001)
    assert b.abort_code == "engine_error" and b.output_ids == []
    assert g.finish_reason == "length" and g.output_ids == single(loaded_bf16, good, params)
    assert pr.d.kv_link.reader_stopped("b")
    assert pr.imp.staging.ledger.num_owned == 0 and pr.imp.staging.ledger.num_quarantined == 0
    assert pr.d.ledger.num_owned == 0
    pr.p.release_kv("g")
    pr.p.abort_kv("b", reader_stopped=True, reason="decode failed")
    assert pr.exp.staging.ledger.num_owned == 0


# -- decode reservations: by need and tenant share, a bounded reservation ahead -----------------

def _admit(pr, ids, params, rid, tenant):
    m = pr.prefill(ids, params, rid, tenant=tenant)
    return pr.d.add_request(ids, params, tenant=tenant, request_id=rid, kv_source=pr.handoff(m))


def _run_until(pr, done, limit_s=60):
    end = time.monotonic() + limit_s
    while not done() and time.monotonic() < end:
        pr.d.step()
        time.sleep(0.001)
    assert done()


def test_a_small_request_of_another_tenant_passes_a_large_one_that_does_not_fit(loaded_bf16):
    """Decode reserves by need: B's small request, arriving after A's large one that waits for
    pages, is reserved at once (strict first-in-first-out made it wait behind A's)."""
    from kvfence.engine.request_states import State
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "8MiB"})
    big, small = SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=8, **GREEDY)
    a1 = _admit(pr, prompt(200, 70), big, "a1", "A")                  # 15 of decode's 22 pages
    a2 = _admit(pr, prompt(200, 71), big, "a2", "A")
    b1 = _admit(pr, prompt(20, 72), small, "b1", "B")
    assert a1.state is State.AWAITING_KV and a2.state is State.WAITING
    assert b1.state is State.AWAITING_KV, "B's small request waited behind A's large one"
    _run_until(pr, lambda: a1.finished and a2.finished and b1.finished)
    assert [s.finish_reason for s in (a1, a2, b1)] == ["length"] * 3
    for rid in ("a1", "a2", "b1"):
        pr.p.release_kv(rid)
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0


def test_a_requests_choices_are_reserved_before_a_later_request(loaded_bf16):
    """Decode orders its queue by the client request, not by each choice: x1, a choice of the
    request whose first choice x0 arrived before y0, is reserved before y0 once the pages for one
    of them free up. (By each choice's own arrival y0 went first: under load a request's choices
    were reserved interleaved with other requests', and a choice's lease ran out while the rest
    of its request generated, failing the request: a probe's heavy n=16 answers all failed.)"""
    from kvfence.engine.request_states import State
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "8MiB"})
    params = SamplingParams(max_tokens=8, **GREEDY)
    f = _admit(pr, prompt(200, 110), SamplingParams(max_tokens=40, **GREEDY), "f", "A")   # 15 of 22 pages
    x0 = _admit(pr, prompt(20, 111), params, "x0", "A")                                   # 2 more
    y0 = _admit(pr, prompt(180, 112), params, "y0", "A")                                  # 12: waits
    ids = prompt(180, 113)
    handoff = {**pr.handoff(pr.prefill(ids, params, "x1", tenant="A")), "choice_of": "x0"}
    x1 = pr.d.add_request(ids, params, tenant="A", request_id="x1", kv_source=handoff)    # 12: waits
    assert f.state is State.AWAITING_KV and x0.state is State.AWAITING_KV
    assert y0.state is State.WAITING and x1.state is State.WAITING
    _run_until(pr, lambda: f.finished)
    pr.d.step()   # 20 pages free at most: one of the two fits
    assert x1.state is not State.WAITING and y0.state is State.WAITING, (x1.state, y0.state)
    _run_until(pr, lambda: all(s.finished for s in (f, x0, y0, x1)))
    assert all(s.finish_reason == "length" for s in (f, x0, y0, x1))
    for s in (f, x0, y0, x1):
        pr.p.release_kv(s.request_id)
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0 and not pr.imp._requests


def test_a_prompts_later_choices_do_not_pass_over_a_request_that_came_after_its_first(loaded_bf16):
    """The bypass bound counts by the queue's own order: y0, which arrived after r0, is not
    passed over when r0's other choices are reserved before it (a review: counted by each
    choice's own arrival, a prompt's BYPASS_LIMIT-th later choice made y0 a barrier and the rest
    waited behind it, interleaving the requests again)."""
    from kvfence.engine.request_states import State
    from kvfence.pd.prefill import BYPASS_LIMIT
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "8MiB"})
    tiny = SamplingParams(max_tokens=1, **GREEDY)
    f = _admit(pr, prompt(150, 120), SamplingParams(max_tokens=8, **GREEDY), "f", "A")   # 10 of 22 pages
    r0 = _admit(pr, prompt(10, 121), tiny, "r0", "A")                                     # 1
    y0 = _admit(pr, prompt(200, 122), SamplingParams(max_tokens=8, **GREEDY), "y0", "A")  # 13: waits
    assert y0.state is State.WAITING
    later = []
    for j in range(BYPASS_LIMIT + 1):   # r0's prompt's other choices, 1 page each: all fit
        ids, rid = prompt(10, 130 + j), f"r{j + 1}"
        handoff = {**pr.handoff(pr.prefill(ids, tiny, rid, tenant="A")), "choice_of": "r0"}
        later.append(pr.d.add_request(ids, tiny, tenant="A", request_id=rid, kv_source=handoff))
    assert all(s.state is State.AWAITING_KV for s in later), [s.state for s in later]
    assert y0.state is State.WAITING and pr.imp._bypassed["y0"] == 0
    _run_until(pr, lambda: all(s.finished for s in (f, r0, y0, *later)))
    assert all(s.finish_reason == "length" for s in (f, r0, y0, *later))
    for s in (f, r0, y0, *later):
        pr.p.release_kv(s.request_id)
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0 and not pr.imp._requests


def test_a_request_passed_over_too_often_stops_the_queue_until_it_fits(loaded_bf16):
    """The bound on need-based order: once BYPASS_LIMIT later requests were reserved past A's
    waiting request, the next one (which fits) waits until A's has been reserved."""
    from kvfence.engine.request_states import State
    from kvfence.pd.prefill import BYPASS_LIMIT
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "8MiB"})
    big, tiny = SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=1, **GREEDY)
    a1 = _admit(pr, prompt(200, 80), big, "a1", "A")
    a2 = _admit(pr, prompt(200, 81), big, "a2", "A")
    assert a2.state is State.WAITING
    passed = []
    for i in range(BYPASS_LIMIT):
        b = _admit(pr, prompt(10, 90 + i), tiny, f"b{i}", "B")
        assert b.state is State.AWAITING_KV
        passed.append(b)
        _run_until(pr, lambda b=b: b.finished)      # done and gone: its pages and rows are back
        pr.p.release_kv(f"b{i}")
    late = _admit(pr, prompt(10, 99), tiny, "late", "B")
    assert late.state is State.WAITING, "a request passed over BYPASS_LIMIT times should stop the queue"
    end = time.monotonic() + 60
    while a2.state is State.WAITING and time.monotonic() < end:   # until A's first request leaves
        assert late.state is State.WAITING
        pr.d.step()
        time.sleep(0.001)
    _run_until(pr, lambda: a1.finished and a2.finished and late.finished)
    assert late.finish_reason == "length" and a2.finish_reason == "length"


def test_a_request_without_max_tokens_reserves_a_step_not_a_context_and_grows(loaded_bf16):
    """No max_tokens: decode reserves the prompt and decode_reserve_tokens, not the whole
    rest of the context, and the request then grows page by page to the same output as a
    single node."""
    short = {"max_model_len": 192}
    pr = Pair(loaded_bf16, prefill_kw=short, decode_kw=short, decode_reserve_tokens=32)
    ids = prompt(60, 100)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    m = pr.prefill(ids, params, "nm")
    seq = pr.d.add_request(ids, params, tenant="t1", request_id="nm", kv_source=pr.handoff(m))
    assert seq.max_tokens == pr.d.usable_context - len(ids)              # it may use the whole context ...
    assert len(seq.table) == pr.d.ledger.pages_for(len(ids) + 32)        # ... but reserves only a step
    _run_until(pr, lambda: seq.finished)
    assert seq.finish_reason == "length" and seq.num_tokens == pr.d.usable_context
    assert seq.output_ids == single(loaded_bf16, ids, SamplingParams(max_tokens=seq.max_tokens, **GREEDY))
    pr.p.release_kv("nm")
    assert pr.d.ledger.num_owned == 0


def test_decode_out_of_pages_mid_generation_preempts_and_recomputes(loaded_bf16):
    """Two requests outgrow decode's pool while generating: the later one is preempted, its
    pages go back through the ledger, decode recomputes its KV from its tokens and both end
    with the single-node output. No error, no page of one read by the other (the ledger's
    check runs on every pass)."""
    pr = Pair(loaded_bf16, decode_kw={"kv_cache_memory": "4MiB"}, decode_reserve_tokens=16)
    params = SamplingParams(max_tokens=60, **GREEDY)
    ids_x, ids_y = prompt(40, 110), prompt(40, 111)
    x = _admit(pr, ids_x, params, "px", "A")
    y = _admit(pr, ids_y, params, "py", "B")
    assert 2 * pr.d.ledger.pages_for(100) > pr.d.ledger.usable_pages       # they cannot both finish at once
    _run_until(pr, lambda: x.finished and y.finished, 120)
    assert pr.d.scheduler.num_preemptions >= 1
    assert x.finish_reason == y.finish_reason == "length"
    assert x.output_ids == single(loaded_bf16, ids_x, params)
    assert y.output_ids == single(loaded_bf16, ids_y, params)
    pr.p.release_kv("px")
    pr.p.release_kv("py")
    assert pr.d.ledger.num_owned == 0 and pr.d.ledger.num_quarantined == 0


NEW_SECRET = b"the cluster's next secret, 32+ bytes long too"


def test_a_cluster_rotating_its_secret_keeps_handing_off(loaded_bf16):
    """A rotation half done: this prefill already seals with the new secret, decode still holds
    the old one and accepts the new (as every node does before any seals with it); the rows
    open by the key id the manifest names, and the answer is the single node's."""
    pr = Pair(loaded_bf16, cluster_secret=SECRET, accepted_secrets=(NEW_SECRET,))
    pr.exp = KvExporter(pr.p, PDSettings("prefill", cluster_secret=NEW_SECRET, accepted_secrets=(SECRET,)),
                        pr.exp.transport)
    ids, params = prompt(40, 21), SamplingParams(max_tokens=6, **GREEDY)
    m = pr.prefill(ids, params, "rot1")
    assert m["seal_key"] == key_id(NEW_SECRET) != key_id(SECRET)
    seq, events = pr.decode(ids, params, "rot1", m)
    assert events[0] == "kv_verified" and seq.output_ids == single(loaded_bf16, ids, params)
    assert pr.p.release_kv("rot1") == "released"


def test_a_secret_a_reload_drops_after_admission_fails_the_request_as_such_not_as_an_attack(loaded_bf16):
    """Step 3 of a rotation by SIGHUP too early: decode admitted a handoff sealed under the
    secret it accepted, then a reload dropped that secret before the rows were opened. The
    request fails with kv_manifest_invalid saying why, and it is not counted (or recorded in
    the incident log) as rows that failed authentication; every row is freed."""
    from kvfence.pd.seal import SecretSet

    pr = Pair(loaded_bf16, cluster_secret=SECRET, accepted_secrets=(NEW_SECRET,))
    pr.exp = KvExporter(pr.p, PDSettings("prefill", cluster_secret=NEW_SECRET, accepted_secrets=(SECRET,)),
                        pr.exp.transport)
    ids, params = prompt(40, 24), SamplingParams(max_tokens=2, **GREEDY)
    m = pr.prefill(ids, params, "rot4")
    seq = pr.d.add_request(ids, params, tenant="t1", request_id="rot4", kv_source=pr.handoff(m))   # admitted
    assert pr.imp.settings.keyring is not None
    pr.imp.settings.keyring.current = SecretSet(SECRET)   # what a reload to the old secret alone swaps in
    for _ in range(2000):
        pr.d.step()
        if seq.finished:
            break
        time.sleep(0.001)
    assert seq.abort_code == "kv_manifest_invalid" and "dropped by a reload" in seq.error, seq.error
    assert pr.imp.counters["verify_failed"] == 0 and pr.imp.counters["verified"] == 0
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0
    pr.p.abort_kv("rot4", reader_stopped=True, reason="test")


def test_rows_sealed_under_a_secret_decode_does_not_hold_are_refused_before_reserving(loaded_bf16, caplog):
    """A prefill that moved to the new secret before this decode node accepted it: the handoff
    is refused at admission, saying what to do (to the operator's log too, once), and nothing
    is reserved or pulled."""
    pr = Pair(loaded_bf16)
    pr.exp = KvExporter(pr.p, PDSettings("prefill", cluster_secret=NEW_SECRET), pr.exp.transport)
    ids, params = prompt(40, 22), SamplingParams(max_tokens=2, **GREEDY)
    m = pr.prefill(ids, params, "rot2")
    before = pr.d.ledger.counters["pages_allocated"]
    with caplog.at_level("WARNING", logger="kvfence.pd.decode"):
        for _ in range(2):
            with pytest.raises(ManifestError, match="does not hold.*--accept-cluster-secret-file"):
                pr.decode(ids, params, "rot2", m)
    assert pr.d.ledger.counters["pages_allocated"] == before and pr.imp.counters["pulls_started"] == 0
    said = [r.message for r in caplog.records if "are refused" in r.message]
    assert len(said) == 1 and m["seal_key"] in said[0]
    pr.p.abort_kv("rot2", reader_stopped=True, reason="test")


def test_a_manifest_without_a_key_id_opens_with_decodes_own_secret(pair, loaded_bf16):
    """An old prefill's manifest (no key id, during a rolling upgrade) is taken as sealed with
    the cluster's one secret."""
    ids, params = prompt(40, 23), SamplingParams(max_tokens=4, **GREEDY)
    m = pair.prefill(ids, params, "rot3")
    m = {k: v for k, v in m.items() if k != "seal_key"}
    seq, events = pair.decode(ids, params, "rot3", m)
    assert events[0] == "kv_verified" and seq.output_ids == single(loaded_bf16, ids, params)
    assert pair.p.release_kv("rot3") == "released"


def test_a_tenant_at_its_running_share_waits_while_another_tenants_request_could_go(loaded_bf16):
    """Decode applies the running share to reservations, as a single node's scheduler does to
    starts: with a slot free, B's request goes before A's older one, A being at its share, though
    A holds fewer pages (which alone would put A's first). Alone, A is not held to its share (its
    handoffs would end with lease_expired while slots sat idle: a review)."""
    from kvfence.engine.request_states import State
    pr = Pair(loaded_bf16, decode_kw={"max_num_seqs": 4, "tenant_running_share": 0.5, "kv_cache_memory": "32MiB"},
              decode_reserve_tokens=16)
    tiny, short, long = (SamplingParams(max_tokens=k, **GREEDY) for k in (2, 40, 60))
    b0 = _admit(pr, prompt(200, 100), long, "b0", "B")               # B: one large request
    a = [_admit(pr, prompt(20, 101), tiny, "a0", "A")] + \
        [_admit(pr, prompt(20, 102 + i), short, f"a{i}", "A") for i in (1, 2)]
    # A is at its share (2) after a1, but alone in the queue: a2 is reserved, the slots are full
    assert all(s.state is State.AWAITING_KV for s in (b0, *a))
    a3 = _admit(pr, prompt(20, 105), short, "a3", "A")
    b1 = _admit(pr, prompt(20, 106), short, "b1", "B")
    assert a3.state is State.WAITING and b1.state is State.WAITING   # no slot
    _run_until(pr, lambda: a[0].finished)                            # a0 ends: one slot
    pr.d.step()
    assert b1.state is not State.WAITING and a3.state is State.WAITING
    _run_until(pr, lambda: all(s.finished for s in (b0, *a, a3, b1)))
    assert all(s.finish_reason == "length" for s in (b0, *a, a3, b1))
    for s in (b0, *a, a3, b1):
        pr.p.release_kv(s.request_id)
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0


def test_a_tenant_running_fewer_is_reserved_past_anothers_preempted_requests(loaded_bf16):
    """Requests preempted on decode go before new reservations, except a tenant's that runs fewer
    sequences there than every tenant with one preempted (as on a single node, the tenant running
    the fewest starts next): a fairness probe saw one tenant's n=16 requests fill decode's pool
    and preempt their own while another tenant's handoff waited up to 40 s."""
    from kvfence.engine.request_states import State
    pr = Pair(loaded_bf16)
    params = SamplingParams(max_tokens=30, **GREEDY)
    a0, a1 = (_admit(pr, prompt(20, 120 + i), params, f"a{i}", "A") for i in range(2))
    _run_until(pr, lambda: a0.state is State.DECODING and a1.state is State.DECODING)
    pr.d.scheduler._preempt(a1)          # as a page shortage does: A has one running, one preempted
    b = _admit(pr, prompt(20, 130), params, "b", "B")
    a2 = _admit(pr, prompt(20, 131), params, "a2", "A")
    assert b.state is State.AWAITING_KV, "B, running none, waited behind A's preempted request"
    assert a2.state is State.WAITING     # A's new one waits for its preempted one
    _run_until(pr, lambda: all(s.finished for s in (a0, a1, a2, b)))
    assert all(s.finish_reason == "length" for s in (a0, a1, a2, b))
    for rid in ("a0", "a1", "a2", "b"):
        pr.p.release_kv(rid)
    assert pr.d.ledger.num_owned == 0 and pr.imp.staging.ledger.num_owned == 0


def test_freed_transfer_rows_go_to_the_tenant_holding_the_fewest(loaded_bf16):
    """Prefill stages computed prompts by the rows their tenant holds, then by arrival: with A
    holding every row, B's prompt gets the first rows that come back, before A's older one (first
    come, first served let one tenant's handoffs hold the buffer: a fairness probe)."""
    ids = [prompt(60, 140 + i) for i in range(5)]
    led = Pair(loaded_bf16).p.ledger
    rows = led.pages_for(59)
    # a buffer of three prompts' rows (it must hold a whole context: the context is that long)
    context = {"max_model_len": 3 * rows * led.page_size}
    pr = Pair(loaded_bf16, prefill_kw=context, decode_kw=context, transfer_buffer_pages=3 * rows)
    params = SamplingParams(max_tokens=4, **GREEDY)
    for i in range(3):
        pr.prefill(ids[i], params, f"a{i}", tenant="A")          # held: every row is A's
    pr.p.add_request(ids[3], params, tenant="A", request_id="a3", hold_kv=True)
    held: list[str] = []

    def step() -> None:
        held.extend(o.seq.request_id for o in pr.p.step() if o.event == "kv_held")

    for _ in range(20):
        step()
    pr.p.add_request(ids[4], params, tenant="B", request_id="b", hold_kv=True)
    for _ in range(20):
        step()
    assert held == [] and [s.request_id for s in pr.exp.pending] == ["a3", "b"]   # both computed, waiting
    pr.p.release_kv("a0")                                        # one request's rows come back
    step()
    assert held == ["b"], held
    pr.p.release_kv("a1")
    step()
    assert held == ["b", "a3"], held
