"""The LM head writes float32 logits: its float32 sums, never rounded to bf16 (issue #16).

Rounded to bf16, logits of this model's magnitude (~10-20) are multiples of 1/16-1/8: near-ties
in float32 became exact ties that the lowest token id won, and every logprob was quantized.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvfence.kernels import cpu_kernels
from kvfence.model.linear import Linear

K = cpu_kernels()
gemm_only = pytest.mark.skipif(K is None or not K.has_gemm, reason="no bf16 matmul (AVX512-BF16 or AVX2) in this build")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _operands(m: int, n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=gen(seed)).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen(seed + 1)).to(torch.bfloat16)
    return x, w, x.double() @ w.double().T


@gemm_only
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (13, 100, 64), (32, 1000, 576), (25, 70, 18), (9, 33, 2)])
def test_float32_gemm_is_the_unrounded_sums(m, n, k):
    """Within fp32 summation noise of float64, far inside bf16's rounding; rounded to bf16 it is the
    bf16 matmul bit for bit (the same sums, one rounding later)."""
    x, w, want = _operands(m, n, k, 20)
    packed = K.pack_weight(w)
    got = K.linear(x, packed, n, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    err = (got.double() - want).abs().max().item()
    assert err < 2e-5 * math.sqrt(k) * want.abs().max().item() + 1e-6, err
    assert torch.equal(got.to(torch.bfloat16), K.linear(x, packed, n))


@gemm_only
def test_float32_gemm_reads_rows_through_their_stride_and_refuses_gated_panels():
    wide = torch.randn(9, 100, generator=gen(22)).to(torch.bfloat16)
    x = wide[:, 10:74]
    w = torch.randn(40, 64, generator=gen(23)).to(torch.bfloat16)
    got = K.linear(x, K.pack_weight(w), 40, out_dtype=torch.float32)
    assert torch.equal(got, K.linear(x.contiguous(), K.pack_weight(w), 40, out_dtype=torch.float32))
    assert K.linear(x[:0], K.pack_weight(w), 40, out_dtype=torch.float32).shape == (0, 40)
    with pytest.raises(ValueError, match="out_dtype"):
        K.linear(x, K.pack_weight(w, w), 40, swiglu=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        K.linear(x, K.pack_weight(w), 40, out_dtype=torch.float16)


@pytest.mark.parametrize("pack", [True, False])
def test_float_out_linear_keeps_what_bf16_would_round_away(pack):
    """Every backend (kvfence's matmul, plain torch) of a float_out Linear returns float32 close to
    float64; the bf16 result is ~100x further off."""
    x, w, want = _operands(32, 2000, 576, 24)
    lm_head = Linear(w, pack=pack, float_out=True)
    got = lm_head(x)
    assert got.dtype == torch.float32
    err = (got.double() - want).abs().max().item()
    bf16_err = (Linear(w, pack=pack)(x).double() - want).abs().max().item()
    assert err * 100 < bf16_err, (err, bf16_err)


def test_float_out_linear_breaks_no_near_tie():
    """Two logits 1/64 apart (one bf16 step at 16 is 1/8) stay apart and in order."""
    k = 64
    w = torch.zeros(4, k)
    w[0, 0], w[1, 0], w[1, 1] = 16.0, 16.0, 1.0 / 64   # logits 16 and 16 + 1/64 for x = e0 + e1
    x = torch.zeros(1, k)
    x[0, 0] = x[0, 1] = 1.0
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    for pack in (True, False):
        logits = Linear(w, pack=pack, float_out=True)(x)
        assert logits[0, 1] - logits[0, 0] == 1.0 / 64
        assert int(torch.argmax(logits)) == 1
        rounded = Linear(w, pack=pack)(x).float()
        assert rounded[0, 0] == rounded[0, 1]   # what bf16 logits did: a tie the lower id wins


def test_model_forward_returns_float32_logits(loaded_bf16):
    from kvfence.model.llama import AttentionRows, ForwardBatch

    model = loaded_bf16.model
    assert model.lm_head.float_out
    cfg, ps = model.config, 16
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314])
    n = len(ids)
    pool = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 2 * ps, cfg.head_dim, dtype=torch.bfloat16)
    batch = ForwardBatch(ids, torch.arange(n), ps + torch.arange(n),
                         AttentionRows(torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), torch.tensor([[1]])),
                         torch.arange(n), ps)
    logits = model.forward(batch, pool)
    assert logits.dtype == torch.float32 and logits.shape == (n, cfg.vocab_size)
    # bf16-rounded logits are multiples of 1/16 (or coarser) at |logit| >= 8; float32 ones are not
    big = logits[logits.abs() >= 8]
    assert len(big) > 100 and (big * 16 != torch.round(big * 16)).float().mean() > 0.9
