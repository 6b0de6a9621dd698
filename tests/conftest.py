"""Shared fixtures: one float32 load of the bundled model, shared by many small engines."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# every server a test starts keeps its incident log (kvfence/incidents.py) under here, and the
# processes it starts inherit it: not in the home directory of whoever runs the tests
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="kvfence-tests-state-")

from kvfence import LLM  # noqa: E402
from kvfence.engine.config import EngineConfig  # noqa: E402
from kvfence.engine.llm_engine import LoadedModel  # noqa: E402


@pytest.fixture(scope="session")
def loaded_fp32() -> LoadedModel:
    return LoadedModel.load(EngineConfig(dtype="float32", progress=False))


@pytest.fixture(scope="session")
def loaded_bf16() -> LoadedModel:
    """The default configuration's weights: bfloat16 (fused kernels where they are built)."""
    return LoadedModel.load(EngineConfig(dtype="bfloat16", progress=False))


def _llm_factory(loaded: LoadedModel, dtype: str, kv_cache_memory: str):
    def make(**kw) -> LLM:
        kw.setdefault("kv_cache_memory", kv_cache_memory)
        kw.setdefault("clamp_context", True)
        kw.setdefault("progress", False)
        return LLM(dtype=dtype, loaded=loaded, **kw)
    return make


@pytest.fixture(scope="session")
def make_llm(loaded_fp32):
    """Build an LLM on the shared float32 weights; keyword arguments go to EngineConfig."""
    return _llm_factory(loaded_fp32, "float32", "64MiB")


@pytest.fixture(scope="session")
def make_llm_bf16(loaded_bf16):
    """The same in the default dtype, bfloat16 (fused kernels where built). 32 MiB of bf16 pages
    is the 1,440-token context that 64 MiB of float32 holds. tests/isolation and tests/pd take it
    as their make_llm."""
    return _llm_factory(loaded_bf16, "bfloat16", "32MiB")


@pytest.fixture(scope="session")
def hf_reference(loaded_fp32):
    """Hugging Face transformers on the same GGUF, float32: the correctness reference."""
    from transformers import AutoModelForCausalLM

    path = loaded_fp32.path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def long_needle(loaded_fp32):
    """The long-context coherence prompt (kvfence/bench/coherence.py): a fact 30% of the way into
    ~3,000 tokens, the question at the end; the seed is one SmolLM2-135M answers."""
    from kvfence.bench.coherence import needle_prompt

    return needle_prompt(loaded_fp32.tokenizer, 3000, depth=0.3, seed=0)


@pytest.fixture(scope="session")
def long_needle_fp32_answer(loaded_fp32, long_needle):
    """The reference for long_needle: float32, greedy, the whole prompt in one prefill pass
    (single node and PD tests compare with it)."""
    llm = LLM(dtype="float32", loaded=loaded_fp32, kv_cache_memory="160MiB", clamp_context=True,
              max_num_batched_tokens=4096, progress=False)
    return llm.generate([long_needle.prompt_ids], long_needle.params())[0]


@pytest.fixture
def open_tmp():
    """A temporary folder the image's user can reach (tests/image_env.py; pytest's tmp_path sits
    under a 0700 folder), removed afterwards."""
    import shutil

    from image_env import open_folder

    path = open_folder()
    yield path
    shutil.rmtree(path, ignore_errors=True)
