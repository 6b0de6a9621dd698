"""`--weights native` on the bundled model: the GGUF's Q4_1 layers and Q8_0 LM head run as they
are (kernels/qgemm.cpp), and what it answers, against float32 of the same weights dequantized.

Measured (kvfence bench --fidelity's small set, 1,203 positions): top-1 agreement 0.973 with the
float32 greedy token, mean |logprob difference| 0.046 (bf16 dequantized: 0.987 / 0.017 on the
full set); the floors below leave room for that and fail on a broken layout (agreement ~0).
The chat France question is a near-tie in float32 ("The" -1.883, "L" -1.965) that int8
activations tip to "L'Étoile"; 8 of the 10 facts are answered right, the plain completion says
Paris.
"""
from __future__ import annotations

import pytest

from kvfence import LLM, SamplingParams
from kvfence.bench import fidelity
from kvfence.bench.coherence import FACTS, says
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LoadedModel
from kvfence.kernels import cpu_kernels

K = cpu_kernels()
pytestmark = pytest.mark.skipif(K is None or not K.has_qgemm,
                                reason="no native (AVX512-VNNI or AVX2) matmul in this build")


@pytest.fixture(scope="module")
def loaded_native() -> LoadedModel:
    return LoadedModel.load(EngineConfig(weights="native", progress=False))


@pytest.fixture(scope="module")
def llm(loaded_native):
    return LLM(weights="native", loaded=loaded_native, kv_cache_memory="64MiB", clamp_context=True, progress=False)


def test_every_matmul_runs_the_files_blocks(loaded_native):
    model = loaded_native.model
    assert model.stack is not None                      # the one-call decoder stack, native matmuls
    mats = [m for layer in model.layers for m in (layer[1], layer[2], layer[4], layer[5])]
    assert {m.backend for m in mats} == {"native"} and {m.format for m in mats} == {"Q4_1"}
    assert model.lm_head.backend == "native" and model.lm_head.format == "Q8_0"
    assert model.embed.dtype.is_floating_point         # the lookup reads a bf16 copy
    assert model.weights_mode == "native"              # what the fleet check compares
    model.lm_head.backend = "kvfence"                   # one matmul fallen back: not native any more
    try:
        assert model.weights_mode == "mixed"
    finally:
        model.lm_head.backend = "native"


def test_native_answers_factual_questions(llm):
    assert K.qgemm_isa in ("avx512-vnni", "avx2") and llm.engine.matmul_path == f"native ({K.qgemm_isa})"
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in FACTS],
                    SamplingParams(temperature=0.0, max_tokens=32))
    right = [word for (_, word), o in zip(FACTS, outs) if says(o.text, word)]
    assert len(right) >= 8, [(q, o.text) for (q, _), o in zip(FACTS, outs)]
    plain = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert "Paris" in plain.text


def test_native_follows_float32_of_the_same_weights(loaded_fp32, loaded_bf16, loaded_native):
    ref, scores = fidelity.run(loaded_fp32.model, loaded_bf16.model, loaded_fp32.tokenizer, max_new=24,
                               long_docs=2, short=4, native_model=loaded_native.model)
    print("\n" + fidelity.table(ref, scores))
    native = next(s for s in scores if s.name.startswith("kvfence native"))
    assert native.positions == ref.positions >= 600
    assert native.agreement >= 0.95 and native.mean_abs_logprob_diff <= 0.08, native
    assert native.exact_ties == 0
