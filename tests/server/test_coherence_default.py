"""What the DEFAULT configuration answers (bf16, fused kernels, the server and the openai client).

The parity tests hold float32 to transformers, and the fused bf16 path was held bit for bit only
to itself; no test read what `kvfence serve` answered. It answered "What is the capital of
France?" with "L'Étoile, la Marseillaise, ..." (#16): the first token is a near-tie in float32
("The" -1.883, "L" -1.965), and logits rounded to bf16 tied it, the lower id winning. Here: a set
of factual questions float32 answers right (checked first, so the set is fair) must be answered
right by the default server too, and its logprobs must not sit on the bf16 grid.
"""
from __future__ import annotations

import pytest
from server_harness import MODEL, LiveServer, SpyEngine

from kvfence import SamplingParams
from kvfence.bench.coherence import FACTS, says
from kvfence.engine.config import EngineConfig
from kvfence.server.app import ServerState
from kvfence.server.engine_loop import EngineLoop
from kvfence.server.isolation import run_startup_checks
from kvfence.server.tenants import TenantRegistry

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def default_server(loaded_bf16):
    cfg = EngineConfig(kv_cache_memory="64MiB", clamp_context=True, progress=False)  # serve's defaults otherwise
    assert cfg.dtype == "bfloat16" and cfg.fused_kernels
    spy = SpyEngine(cfg, loaded_bf16)
    engine = EngineLoop(spy, run_startup_checks).start()
    assert engine.wait_ready(60), engine.error
    srv = LiveServer(ServerState(engine, TenantRegistry.single(), None), spy)
    yield srv
    srv.stop()


def test_float32_answers_every_question(make_llm):
    """The premise: the reference knows these answers (else bf16 could not be held to them)."""
    llm = make_llm()
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in FACTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    wrong = [(q, o.text) for (q, word), o in zip(FACTS, outs) if not says(o.text, word)]
    assert not wrong, wrong


def test_the_server_runs_the_default_compute_path(default_server):
    from kvfence.kernels import cpu_kernels

    model = default_server.spy.loaded.model
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.bfloat16"
    if cpu_kernels() is not None:
        assert model.kernels is not None   # the fused path, as `kvfence serve` runs it here


@pytest.mark.parametrize("question,word", FACTS, ids=[w for _, w in FACTS])
def test_default_server_answers(default_server: LiveServer, question, word):
    client = default_server.client(None)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    text = r.choices[0].message.content
    assert says(text, word), text


def test_logprobs_are_not_on_the_bf16_grid(default_server: LiveServer):
    """bf16 logits of 2 or more in magnitude are multiples of 1/64, so the differences between
    one position's logprobs were too (the issue saw multiples of 1/8): float32 ones are not."""
    client = default_server.client(None)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FACTS[0][0]}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    diffs = [t.logprob - c.top_logprobs[0].logprob for c in r.choices[0].logprobs.content for t in c.top_logprobs[1:]]
    assert len(diffs) >= 24
    off_grid = [d for d in diffs if abs(d * 64 - round(d * 64)) > 1e-3]
    assert len(off_grid) > 0.8 * len(diffs), diffs
    first = r.choices[0].logprobs.content[0]
    assert first.token == "The", first
    alt = {t.token: t.logprob for t in first.top_logprobs}
    assert alt["The"] != alt.get("L"), alt   # the near-tie stays a near-tie, not an exact one
