"""The deterministic PD simulation (kvfence/sim): clean runs hold I1-I9 after every step, the
same seed replays exactly, and the checker catches each fault point and protocol mutant.

The two bugs the simulation found (KNOWN_BUGS) are fixed; their repros with the real
classes alone stay below as regression tests, and the clean runs excuse nothing. Each run
uses the real LLMEngine, KvExporter and KvImporter on a tiny random model.
"""
from __future__ import annotations

import functools

import pytest
import torch

from kvfence import faults
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.params import SamplingParams
from kvfence.kv.pool import page_bytes
from kvfence.pd.prefill import KvExporter
from kvfence.pd.settings import PDSettings
from kvfence.pd.transfer import InProcessTransport
from kvfence.sim.cluster import SIM_SECRET as SECRET
from kvfence.sim.cluster import SimFailure, shared_model, simulate

KNOWN: tuple[str, ...] = ()  # open bugs the clean runs excuse: none
# seeds whose drawn configurations between them exercise every failure path and the network
# adversary (a scan of seeds 0-59 picked the cheapest three); any seed must pass, these also
# cover the ground
CLEAN_SEEDS = (14, 55, 15)
CLEAN_LIVES = 1000


@functools.cache
def clean(seed: int):
    return simulate(seed, CLEAN_LIVES, known_bugs=KNOWN)


def caught(fault_points, seeds, lives, **overrides) -> SimFailure:
    """Run seeds with the faults on until the checker reports a violation; return it."""
    for seed in seeds:
        try:
            with faults.injected(*fault_points):
                simulate(seed, lives, known_bugs=KNOWN, **overrides)
        except SimFailure as e:
            print(e.report())
            return e
    pytest.fail(f"no seed in {list(seeds)} caught {fault_points or overrides}")


@pytest.mark.parametrize("seed", CLEAN_SEEDS)
def test_clean_run_holds_every_invariant(seed):
    r = clean(seed)
    print(f"seed {seed}: {r.lives} lives, {r.steps} steps, {r.seconds:.1f} s; {dict(r.outcomes)}")
    assert r.lives == CLEAN_LIVES
    assert sum(v for k, v in r.outcomes.items() if k.startswith("200")) > 0
    assert sum(r.outcomes.values()) == CLEAN_LIVES   # every request answered (or its client gone)


def test_clean_runs_cover_the_failure_paths():
    """Between them the clean runs really exercise what the simulation claims to inject."""
    stats, outcomes = {}, {}
    for seed in CLEAN_SEEDS:
        r = clean(seed)
        for k, v in r.stats.items():
            stats[k] = stats.get(k, 0) + v
        for k, v in r.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + v
    for key in ("transport_ok", "transport_fail", "transport_partial", "transport_corrupt", "transport_short_ok",
                "transport_cut", "transport_drop", "transport_duplicate", "decode_fences", "prefill_fences",
                "decode_late_notices", "decode_stale_notices", "decode_verify_failed", "decode_pulls_given_up",
                "prefill_leases_expired", "crash_prefill", "crash_decode", "adversary_read", "adversary_write",
                # a decode node died before it answered the router's stop_pull: prefill is told a
                # read may still run, and fences (I6)
                "stop_pull_unanswered"):
        assert stats.get(key), (key, stats)
    for key in ("200 length", "client gone", "error context_length_exceeded", "error kv_transfer_timeout",
                "error kv_transfer_failed", "error kv_verification_failed", "error lease_expired",
                "error node_failed"):
        assert outcomes.get(key), (key, outcomes)


def test_same_seed_replays_exactly():
    a = simulate(7, 150, known_bugs=KNOWN)
    b = simulate(7, 150, known_bugs=KNOWN)
    assert (a.digest, a.steps, a.outcomes, a.stats) == (b.digest, b.steps, b.outcomes, b.stats)
    c = simulate(8, 150, known_bugs=KNOWN)
    assert c.digest != a.digest


def test_a_failing_seed_reproduces_with_its_trace():
    runs = []
    for _ in range(2):
        with pytest.raises(SimFailure) as e, faults.injected("free_on_abort_during_transfer"):
            simulate(1, 300, known_bugs=KNOWN)
        runs.append(e.value)
    a, b = runs
    assert (a.seed, a.step, a.invariant, a.message) == (b.seed, b.step, b.invariant, b.message)
    assert a.trace == b.trace and len(a.trace) > 10
    assert f"seed {a.seed}" in a.report() and a.trace[-1] in a.report()


# -- each fault point is caught ----------------------------------------------------------------

def test_free_on_abort_during_transfer_is_caught_as_I6():
    e = caught(["free_on_abort_during_transfer"], range(4), 300)
    assert e.invariant == "I6" and "still in flight" in e.message


def test_skip_row_auth_lets_a_corrupted_pull_through_and_the_content_oracle_catches_it():
    e = caught(["skip_row_auth"], range(4), 200, pull_fates={"ok": 0.7, "corrupt": 0.3})
    assert e.invariant == "I5" and "does not hold the KV prefill staged" in e.message


def test_corrupt_staged_page_is_an_error_nothing_injected_explains():
    e = caught(["corrupt_staged_page"], range(4), 200)
    assert e.invariant == "outcome" and "kv_verification_failed" in e.message


def test_handoff_placeholder_is_caught_as_I4():
    e = caught(["handoff_placeholder"], range(4), 200, router_check=0.0)
    assert e.invariant == "I4" and "prefill admitted" in e.message


INCIDENT = ["handoff_placeholder", "skip_manifest_check", "attend_reserved_length"]
# the incident end to end: prefill hands off a one-token placeholder of an over-length prompt,
# decode (whose context is larger) takes it and attends the reserved length; the simulation's
# own I4/I5 checks are off, so only the ledgers and the read audits stand in the way
INCIDENT_CFG = dict(router_check=0.0, context=32, decode_context=64, check_admission=False, check_handoff=False)


def test_incident_chain_is_stopped_by_the_ledger_watermark_check():
    e = caught(INCIDENT, range(4), 200, **INCIDENT_CFG)
    assert e.invariant == "I3" and "read check fired" in e.message


def test_incident_chain_with_skip_watermark_is_caught_by_the_read_audit():
    e = caught(INCIDENT + ["skip_watermark"], range(4), 200, **INCIDENT_CFG)
    assert e.invariant == "I3" and "read audit" in e.message and "read unwritten" in e.message


def test_incident_chain_is_caught_at_admission_by_default():
    e = caught(INCIDENT, range(4), 200, router_check=0.0, context=32, decode_context=64)
    assert e.invariant == "I4"


def test_lease_fence_mutant_is_caught_as_I6_on_prefill(monkeypatch):
    """spec mutant d: rows of a lease that ended without an ACK are freed at the deadline,
    not fenced until no pull can still read them."""
    monkeypatch.setattr(PDSettings, "fence_after", lambda self, deadline: deadline)
    e = caught([], range(6), 300)
    assert e.invariant == "I6" and "prefill rows" in e.message


def test_fence_shorter_than_the_longest_pull_is_caught_as_I6(monkeypatch):
    """The fence must outlast any pull that started before the deadline (deadline + max_pull_s
    + skew); one a quarter of max_pull_s long lets a slow pull read reused rows."""
    monkeypatch.setattr(PDSettings, "fence_after", lambda self, deadline: deadline + self.max_pull_s * 0.25)
    e = caught([], range(6), 300, slow_pulls=0.3)
    assert e.invariant == "I6" and "prefill rows" in e.message


# -- the bugs the simulation found, each on the real classes alone -----------------------------

def tiny_engine(pages: int, context: int = 32, **kw) -> LLMEngine:
    loaded = shared_model(1, 32)
    pb = page_bytes(loaded.model.config, 4, torch.float32)
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", page_size=4, kv_cache_memory=(pages + 1) * pb,
                                  max_model_len=context, scrub="none", num_threads=1, progress=False, **kw), loaded)


def test_prefill_does_not_abort_a_request_that_fits_while_pages_wait_for_rows():
    """KNOWN_BUGS['pool_held_outside_scheduler'] (fixed in 720c56b): a prompt computed on
    prefill waits for transfer-buffer rows holding its pool pages (they come back when a
    lease ends); a new request that fits the pool must wait, not fail with kv_pool_exhausted."""
    eng = tiny_engine(12)
    exp = KvExporter(eng, PDSettings("prefill", transfer_buffer_pages=8, cluster_secret=SECRET), InProcessTransport())
    params = SamplingParams(max_tokens=1)

    def steps():
        out = []
        for _ in range(10):
            out += eng.step()
        return out

    eng.add_request(list(range(10, 40)), params, request_id="A", hold_kv=True)  # 29 tokens: all 8 rows, held
    assert [o.event for o in steps()] == ["kv_held"] and exp.staging.ledger.num_free == 0
    eng.add_request(list(range(50, 80)), params, request_id="B", hold_kv=True)  # computed; waits for rows
    steps()
    assert [s.request_id for s in exp.pending] == ["B"]
    c = eng.add_request(list(range(90, 110)), params, request_id="C", hold_kv=True)  # 5 pages of 12
    steps()
    assert c.abort_code != "kv_pool_exhausted", c.error


class _Now:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _serve_once(eng: LLMEngine, now: _Now) -> str | list:
    """One turn of kvfence/server/engine_loop.py when no command comes: with no work it sleeps
    until the engine's next timer (and blocks for good without one), then steps."""
    if not eng.has_unfinished():
        t = eng.next_timer()
        if t is None:
            return "blocked"
        now.t = max(now.t, t)
    return [(o.seq.request_id, o.event) for o in eng.step()]


def test_prefill_stages_a_waiting_prompt_when_a_fence_frees_the_rows():
    """A prompt waits for transfer-buffer rows that a fence holds. When the fence lifts (in
    KvExporter.poll, after poll already tried to stage), the prompt must be staged, or at
    least the engine must report work or a timer; instead the loop blocks for good."""
    eng = tiny_engine(12)
    now = _Now()
    eng.clock = now
    exp = KvExporter(eng, PDSettings("prefill", transfer_buffer_pages=8, cluster_secret=SECRET, lease_s=2.0,
                                     max_pull_s=3.0, clock_skew_s=0.2, transfer_timeout_s=1), InProcessTransport())
    params = SamplingParams(max_tokens=1)
    eng.add_request(list(range(10, 40)), params, request_id="A", hold_kv=True)  # all 8 rows; no ACK ever comes
    assert _serve_once(eng, now) == [("A", "kv_held")]
    eng.add_request(list(range(50, 80)), params, request_id="B", hold_kv=True)  # computed, waits for rows
    turns = [_serve_once(eng, now) for _ in range(6)]   # A's lease expires, its fence lifts
    assert exp.staging.ledger.num_free == 8
    assert ("B", "kv_held") in [o for t in turns if isinstance(t, list) for o in t], turns


def test_decode_reserves_a_waiting_request_when_pages_come_back():
    """Decode serves one request at a time (max_num_seqs=1); B waits behind A. When A finishes
    the engine has no work, so the loop sleeps until B's lease deadline and B fails with
    lease_expired, although it could have been reserved the moment A ended."""
    from kvfence.pd.decode import KvImporter

    pre = tiny_engine(24)
    dec = tiny_engine(24, max_num_seqs=1, enable_prefix_cache=False)
    now = _Now()
    pre.clock = dec.clock = now
    settings = dict(lease_s=30.0, max_pull_s=75.0, clock_skew_s=1.0, cluster_secret=SECRET)
    exp = KvExporter(pre, PDSettings("prefill", **settings), InProcessTransport())
    imp = KvImporter(dec, PDSettings("decode", **settings), InProcessTransport())

    class Inline:  # run each pull at once, in this thread
        def submit(self, fn, *args):
            fn(*args)

        def shutdown(self, **kw):
            pass

    imp._workers.shutdown(wait=False)
    imp._workers = Inline()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    manifests = {}
    for rid, base in (("A", 10), ("B", 60)):
        pre.add_request(list(range(base, base + 20)), params, request_id=rid, hold_kv=True)
        for _ in range(3):
            for o in pre.step():
                if o.event == "kv_held":
                    manifests[rid] = o.data
    for rid, base in (("A", 10), ("B", 60)):
        source = {"session": exp.transport.session_id, "base": exp.base, "boot_id": exp.boot_id}
        dec.add_request(list(range(base, base + 20)), params, request_id=rid,
                        kv_source={"manifest": manifests[rid], "source": source})
    assert [s.request_id for s in imp.waiting] == ["B"]
    events = []
    for _ in range(8):
        t = _serve_once(dec, now)
        events += t if isinstance(t, list) else [t]
    b = [o for o in events if o == ("B", "kv_verified")]
    assert b, f"B was never reserved after A finished: {events}, B ended as {dec.requests.get('B')}"


def test_prefill_waits_instead_of_recomputing_while_pages_wait_for_rows():
    """Found by the simulation: pending prompts (waiting for transfer rows) hold the pool,
    and the one prefill still computing needs another page. It used to be preempted and
    rescheduled every step, recomputing the same chunk until rows came back; now it keeps
    its pages and computed KV and the engine reports no work (the server loop blocks)."""
    from kvfence.sim.model import tiny_loaded

    loaded = tiny_loaded()
    pb = page_bytes(loaded.model.config, 4, torch.float32)
    eng = LLMEngine(EngineConfig(dtype="float32", device="cpu", page_size=4, kv_cache_memory=13 * pb,
                                 max_model_len=32, scrub="none", num_threads=1, progress=False,
                                 max_num_batched_tokens=8), loaded)
    exp = KvExporter(eng, PDSettings("prefill", transfer_buffer_pages=8, cluster_secret=SECRET), InProcessTransport())
    params = SamplingParams(max_tokens=1)
    for rid, start in (("A", 10), ("B", 50)):
        eng.add_request(list(range(start, start + 30)), params, request_id=rid, hold_kv=True)
        for _ in range(6):
            eng.step()
    assert [s.request_id for s in exp.pending] == ["B"]
    eng.add_request(list(range(90, 120)), params, request_id="C", hold_kv=True)
    for _ in range(12):
        eng.step()
    c = eng.requests["C"]
    assert c.num_preemptions == 0 and c.num_computed > 0
    assert not eng.has_unfinished()
    exp.engine.release_kv("A")  # rows come back: B is staged, its pool pages free, C goes on
    for _ in range(12):
        eng.step()
    assert c.state.value == "KV_HELD" or c.num_computed == 29


# -- the network adversary (kvfence/sim/adversary.py) ------------------------------------------

NO_TRANSFER_FAULTS = dict(pull_fates={"ok": 1.0}, notice_fates={"deliver": 1.0}, w_crash=0.0)


@pytest.mark.parametrize("seed", [3, 11])
def test_a_network_adversary_breaks_no_invariant(seed):
    """Reads, writes, splices, replays and forged calls at a high rate: every invariant holds
    after every step, and its writes are what the failed verifications are."""
    r = simulate(seed, 150, known_bugs=KNOWN, w_adversary=0.5, **NO_TRANSFER_FAULTS)
    print(dict(r.stats))
    for kind in ("read", "write", "splice", "forge", "replay"):
        assert r.stats[f"adversary_{kind}"] > 0, kind
    assert sum(v for k, v in r.outcomes.items() if k.startswith("200")) > 0


def test_without_authentication_the_adversarys_writes_reach_a_200_and_the_oracle_catches_it():
    e = caught(["skip_row_auth"], range(6), 150, w_adversary=0.5, **NO_TRANSFER_FAULTS)
    assert e.invariant == "I5" and "does not hold the KV prefill staged" in e.message


def test_without_sealing_the_adversary_reads_a_held_row_in_the_clear():
    # frequent enough that a read of a held row comes before its failed verification
    e = caught(["skip_row_seal"], range(6), 150, w_adversary=8.0, **NO_TRANSFER_FAULTS)
    assert e.invariant == "I10" and "in the clear" in e.message
