"""Load shedding: more concurrent requests than the node's waiting queue holds. Some get 503
server_overloaded with Retry-After at once, none hang, every 200 is the text the same request
gets alone, and afterwards the pool is back at baseline; one tenant cannot take the whole
queue while another waits."""
from __future__ import annotations

import threading

import openai
import pytest
from server_harness import MODEL, pool_intact, wait_for

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def small(make_server):
    return make_server(max_num_seqs=1, max_waiting=2)


def ask(srv, who="alice"):
    return srv.client(who).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})


def burst(srv, who_list) -> list:
    out: list = [None] * len(who_list)

    def run(i, who):
        try:
            out[i] = ask(srv, who).choices[0].text
        except openai.APIStatusError as e:
            out[i] = e
    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(who_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out


def test_more_requests_than_the_queue_holds(small):
    reference = ask(small).choices[0].text
    out = burst(small, ["alice"] * 8)
    refused = [o for o in out if isinstance(o, openai.APIStatusError)]
    served = [o for o in out if isinstance(o, str)]
    assert refused and served, out
    for e in refused:
        assert e.status_code == 503 and e.code == "server_overloaded", e
        assert int(e.response.headers["retry-after"]) >= 1
    assert all(t == reference for t in served)
    wait_for(lambda: pool_intact(small.wait_idle()))
    assert pool_intact(small.engine.snapshot)
    assert small.metric("kvfence_admission_rejections_total", reason="server_overloaded") >= len(refused)


def test_one_tenant_holds_at_most_half_the_queue(loaded_fp32):
    """The engine's own rule, step by step: with a queue of 4 (max_num_seqs 1), alice may hold
    2 waiting places; her third is refused, bob still gets in."""
    from kvfence.engine.admission import Overloaded
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.params import SamplingParams

    eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=1,
                                 max_waiting=4, progress=False), loaded_fp32)
    p = SamplingParams(max_tokens=4)
    eng.add_request([1, 2, 3], p, tenant="alice")
    eng.step()                                   # the first one runs
    eng.add_request([1, 2, 3], p, tenant="alice")
    eng.add_request([1, 2, 3], p, tenant="alice")
    with pytest.raises(Overloaded, match="for this tenant") as e:
        eng.add_request([1, 2, 3], p, tenant="alice")
    assert "2 of its requests" in str(e.value) and "4" not in str(e.value)   # not the server's queue size
    eng.add_request([1, 2, 3], p, tenant="bob")
    eng.add_request([1, 2, 3], p, tenant="bob")
    with pytest.raises(Overloaded, match="for this tenant"):   # its own share first, whatever the queue holds
        eng.add_request([1, 2, 3], p, tenant="bob")
    with pytest.raises(Overloaded, match="queue is full") as e:
        eng.add_request([1, 2, 3], p, tenant="carol")
    assert not any(ch.isdigit() for ch in str(e.value))   # how many others wait is not carol's to know
    while eng.has_unfinished():
        eng.step()
    assert eng.ledger.num_owned == 0


def test_a_request_with_more_choices_than_its_tenant_may_queue_is_told_to_send_fewer(make_server):
    """With --max-waiting 4 and a tenants file a tenant may have 2 requests waiting, and a
    request's choices wait together (the later ones for the first's prompt): n=16 got 503
    "retry shortly" on every retry, and n=3 was served or refused by timing (whether the first
    choice started before the others queued). Both get a 400 naming n and the most it may ask,
    every time, which the model card says too; n=2 is served, and nothing is held."""
    srv = make_server(max_num_seqs=1, max_waiting=4)
    c = srv.client("alice")
    assert c.models.list().data[0].model_dump()["max_choices"] == 2
    for n in (3, 16):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=n, temperature=0.7)
        assert e.value.code == "too_many_choices" and e.value.param == "n" and "at most 2" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:   # prompts x n
        c.completions.create(model=MODEL, prompt=[PROMPT, PROMPT, PROMPT], max_tokens=4, temperature=0.7)
    assert e.value.code == "too_many_choices" and e.value.param == "prompt" and "3 choices" in e.value.message
    assert len(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=0.7).choices) == 2
    assert wait_for(lambda: pool_intact(srv.wait_idle()))
    assert srv.metric("kvfence_admission_rejections_total", reason="server_overloaded") == 0


def test_a_tenant_that_queues_many_does_not_make_the_next_tenant_wait_for_all(loaded_fp32):
    """The real engine, one slot: alice queues three, then bob one. Bob's runs second, not
    fourth (engine/scheduler.py starts waiting requests tenant by tenant)."""
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.params import SamplingParams

    eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=1,
                                 progress=False), loaded_fp32)
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    ids = [eng.add_request([1, 2, 3], p, tenant="alice").request_id for _ in range(3)]
    ids.append(eng.add_request([4, 5, 6], p, tenant="bob").request_id)
    finished: list[str] = []
    while eng.has_unfinished():
        finished += [o.seq.request_id for o in eng.step() if o.finished]
    assert finished == [ids[0], ids[3], ids[1], ids[2]]
    assert eng.ledger.num_owned == 0


def test_a_single_tenant_server_gives_its_tenant_every_waiting_place(loaded_fp32, monkeypatch, tmp_path):
    """Half the queue is kept for other tenants; `kvfence serve` without a tenants file has
    none, and refused its one client at half of --max-waiting."""
    import types

    from kvfence.engine.admission import Overloaded
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.params import SamplingParams
    from kvfence.server import serve

    started: list[EngineConfig] = []

    def start_engine(config):   # what serve() would run, without loading a model
        started.append(config)
        return types.SimpleNamespace(wait_ready=lambda: False, error="stopped by the test")

    monkeypatch.setattr(serve, "start_engine", start_engine)
    tenants = tmp_path / "t.toml"
    tenants.write_text("[tenants.a]\napi_keys = ['sk-aaaaaaaa']\n")
    base = EngineConfig(dtype="float32", max_waiting=4)
    assert serve.serve(base, port=0, tenants_file=None) == 2
    assert serve.serve(base, port=0, tenants_file=str(tenants)) == 2
    assert [c.tenant_waiting_share for c in started] == [1.0, 0.5]

    eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=1,
                                 max_waiting=4, tenant_waiting_share=1.0, progress=False), loaded_fp32)
    p = SamplingParams(max_tokens=4)
    eng.add_request([1, 2, 3], p)
    eng.step()                                   # the first one runs
    for _ in range(4):
        eng.add_request([1, 2, 3], p)
    with pytest.raises(Overloaded, match="queue is full"):
        eng.add_request([1, 2, 3], p)
    while eng.has_unfinished():
        eng.step()


def test_a_step_budget_under_the_prefill_cap_does_not_stop_the_node(loaded_fp32):
    """--max-num-batched-tokens 32 under the default prefill cap (256): two tenants' long prompts
    fill a small pool, a third tenant's request arrives when it cannot start. The running
    prefills kept a quarter of the cap (64 tokens) for it, more than the whole budget, so none
    ran or gave up its pages: all three requests stalled for good (the PD simulation's n > 1
    campaign found it; tests/unit/test_scheduler.py holds the rule)."""
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.params import SamplingParams

    eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="14MiB", max_model_len=256, clamp_context=True,
                                 max_num_batched_tokens=32, decode_step_target_ms=0, progress=False), loaded_fp32)
    led = eng.ledger
    assert eng.scheduler.prefill_budget_while_decoding == 256 and led.usable_pages < 26   # two prompts overflow it
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request([100 + i for i in range(200)], p, tenant="alice", request_id="a")
    eng.add_request([300 + i for i in range(200)], p, tenant="carol", request_id="c")
    for _ in range(40):
        if led.num_available <= 1:
            break
        eng.step()
    assert led.num_available <= 1
    eng.add_request([500 + i for i in range(40)], p, tenant="bob", request_id="b")   # cannot start now
    finished: set[str] = set()
    for _ in range(200):
        finished |= {o.seq.request_id for o in eng.step() if o.finished}
        if len(finished) == 3:
            break
    assert finished == {"a", "b", "c"}, {rid: (s.state.value, s.num_computed) for rid, s in eng.requests.items()}
    led.check_consistency()
