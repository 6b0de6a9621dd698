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


NEAR_TIE = 0.1   # nats between float32's top two tokens: the fidelity bench's near-tie


@pytest.fixture(scope="module")
def float32_answers(make_llm) -> dict[str, list[tuple[str, float]]]:
    """question -> float32's greedy answer as (token text, top-2 margin) per token."""
    llm = make_llm()
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in FACTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    answers = {}
    for (q, _), o in zip(FACTS, outs):
        steps = []
        for tid, lp in zip(o.token_ids, o.logprobs):
            top = sorted((v for _, v in lp.top), reverse=True)
            steps.append((llm.tokenizer.decode([tid], False), top[0] - top[1]))
        answers[q] = steps
    return answers


def test_float32_answers_every_question(float32_answers):
    """The premise: the reference knows these answers (else bf16 could not be held to them)."""
    wrong = [(q, "".join(t for t, _ in float32_answers[q])) for q, word in FACTS
             if not says("".join(t for t, _ in float32_answers[q]), word)]
    assert not wrong, wrong


def test_the_server_runs_the_default_compute_path(default_server):
    from kvfence.kernels import cpu_kernels

    model = default_server.spy.loaded.model
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.bfloat16"
    if cpu_kernels() is not None:
        assert model.kernels is not None   # the fused path, as `kvfence serve` runs it here


@pytest.mark.parametrize("question,word", FACTS, ids=[w for _, w in FACTS])
def test_default_server_answers(default_server: LiveServer, float32_answers, question, word):
    """The default's answer names the word; or it left float32's answer only where float32
    itself nearly tied (top two within NEAR_TIE), where bf16's error (mean 0.012 nats, up to
    ~0.15, docs/performance.md) may pick either: that is a coin float32 flipped, not a wrong
    answer. ("Which planet is known as the Red Planet?": float32 goes "... in the solar" by 0.074
    over "habitable", then "system known as Mars"; the AVX-512 default picks "habitable".)"""
    client = default_server.client(None)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=MAX_TOKENS, temperature=0, logprobs=True)
    text = r.choices[0].message.content
    if says(text, word):
        return
    ours = [c.token for c in r.choices[0].logprobs.content]
    ref = float32_answers[question]
    at = next((i for i, (t, (f, _)) in enumerate(zip(ours, ref)) if t != f), min(len(ours), len(ref)))
    assert at < len(ref) and ref[at][1] < NEAR_TIE, (
        f"{text!r} left float32's answer {''.join(t for t, _ in ref)!r} at token {at}, where float32's margin "
        f"is {ref[at][1] if at < len(ref) else None}: not a near-tie")


def test_most_answers_name_the_word_outright(default_server: LiveServer):
    """Excused near-ties stay the exception: at least 9 of the 10 answers say the word."""
    client = default_server.client(None)
    right = [word for q, word in FACTS if says(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0,
    ).choices[0].message.content, word)]
    assert len(right) >= len(FACTS) - 1, right


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
