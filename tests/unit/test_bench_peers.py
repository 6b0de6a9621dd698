"""The vLLM peer's protocol (kvfence/bench/vllm_peer.py run by another interpreter), against a
stand-in `vllm` package: the real one lives in its own venv and is not installed for the tests."""
from __future__ import annotations

import sys
import textwrap

from kvfence.bench.peers import VllmPeer, llama_cpp_result

FAKE_VLLM = '''
__version__ = "0.0-fake"
import time
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos): self.max_tokens = max_tokens
class _Out:
    def __init__(self, ids): self.token_ids = ids
class _Req:
    def __init__(self, ids): self.outputs = [_Out(ids)]
class LLM:
    calls = 0
    def __init__(self, **kw): self.kw = kw
    def generate(self, prompts, params, use_tqdm=False):
        LLM.calls += 1
        time.sleep(0.2 if LLM.calls == 2 else 0.01)    # the first timed round is the slow one
        return [_Req([7] * params.max_tokens) for _ in prompts]
'''


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_vllm_peer_starts_once_runs_rounds_and_is_stopped_in_between(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "inputs.py").write_text("class TokensPrompt(dict):\n"
                                   "    def __init__(self, prompt_token_ids): super().__init__(ids=prompt_token_ids)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    peer = VllmPeer(sys.executable, "/nowhere", [[1, 2, 3], [4, 5]], output_tokens=4, threads=2, timeout=60)
    try:
        assert "vLLM 0.0-fake" in peer.settings and "bind 0-1" in peer.settings
        assert _state(peer.proc.pid) == "T"        # stopped while kvfence's rounds run
        rounds = [peer.round() for _ in range(3)]
        assert _state(peer.proc.pid) == "T"
    finally:
        peer.close()
    assert peer.proc.returncode == 0              # asked to quit, it did
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 5 for r in rounds)
    assert rounds[0]["seconds"] > rounds[1]["seconds"]   # the stand-in's slow first round, timed as such


def test_llama_cpp_answer_becomes_a_bench_row():
    r = {"seconds": 2.0, "output_tokens": 4, "prompt_tokens": 6, "first_token_times": [0.5, 0.7],
         "token_times": [[0.5, 0.6], [0.7, 0.9]], "settings": "s"}
    row = llama_cpp_result("llama.cpp", r)
    assert row.output_tps == 2.0 and row.total_tokens == 10
    assert row.ttft_ms and row.itl_ms     # percentiles in milliseconds
