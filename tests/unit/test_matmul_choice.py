"""--matmul: whose bf16 matmul runs the decoder layers on CPU. auto picks oneDNN's on a CPU with
AMX tiles (oneDNN runs bf16 on them; kvfence's kernel has none, docs/performance.md) and
kvfence's elsewhere; the LM head stays kvfence's, so logits stay float32 (#16)."""
from __future__ import annotations

import pytest
import torch

from kvfence.engine.config import EngineConfig
from kvfence.kernels import build as kernel_build
from kvfence.kernels import cpu_kernels
from kvfence.model import linear
from kvfence.model.linear import Linear, SwiGLU, resolve_matmul


def test_auto_picks_onednn_only_on_a_cpu_with_amx(monkeypatch):
    monkeypatch.setattr(linear, "_onednn_bf16", lambda: True)
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert resolve_matmul("auto") == "onednn"
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "avx2"})
    assert resolve_matmul("auto") == "kvfence"
    # AMX, but a torch whose oneDNN has no bf16 matmul: kvfence's
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setattr(linear, "_onednn_bf16", lambda: False)
    assert resolve_matmul("auto") == "kvfence"
    assert resolve_matmul("onednn") == "onednn" and resolve_matmul("kvfence") == "kvfence"
    with pytest.raises(ValueError, match="matmul must be one of"):
        resolve_matmul("amx")
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="amx")


def test_cpu_flags_reads_this_machines_flags():
    flags = kernel_build.cpu_flags()
    assert isinstance(flags, set) and all(" " not in f for f in flags)


@pytest.mark.skipif(not linear._onednn_bf16(), reason="no oneDNN bf16 matmul on this CPU")
def test_onednn_layers_keep_the_lm_head_on_kvfences_float32_matmul():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    lin = Linear(w, matmul="onednn")
    assert lin.backend == "onednn"
    torch.testing.assert_close(lin(x).float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)
    head = Linear(w, float_out=True, matmul="onednn")
    kernels = cpu_kernels()
    if kernels is not None and kernels.has_gemm:
        assert head.backend == "kvfence"
    assert head(x).dtype == torch.float32
    up = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    mlp = SwiGLU(w, up, matmul="onednn")
    assert mlp.backend == "onednn" and mlp.gated is None
    want = torch.nn.functional.silu(x.float() @ w.float().T) * (x.float() @ up.float().T)
    torch.testing.assert_close(mlp(x).float(), want, rtol=3e-2, atol=3e-2)
