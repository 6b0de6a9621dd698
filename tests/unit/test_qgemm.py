"""The native matmul over GGUF blocks (kernels/qgemm.cpp) against references: an exact emulation
of its arithmetic (int8 activations per row and 32-block, integer block sums, fp32 scaling), the
float32 matmul of the dequantized weights, random and the bundled model's own blocks; and the
shape checks the C side makes before it reads anything."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from kvfence.kernels import cpu_kernels
from kvfence.model.quant import QuantWeight

gguf = pytest.importorskip("gguf")
K = cpu_kernels()
# the refusal test runs on every build (the C side checks shapes and headers before it asks
# whether it can compute); the rest need the native matmul itself (AVX512-VNNI or AVX2)
pytestmark = pytest.mark.skipif(K is None, reason="no CPU kernels in this build")
needs_native = pytest.mark.skipif(K is None or not K.has_qgemm,
                                  reason="no native (AVX512-VNNI or AVX2) matmul in this build")
Q4_0, Q4_1, Q8_0 = 2, 3, 8


def random_weight(ggml_type: int, n: int, k: int, seed: int = 0) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return QuantWeight(ggml_type, n, k, gguf.quants.quantize(w, gguf.GGMLQuantizationType(ggml_type)))


def bf16_rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def emulate(x: torch.Tensor, w: QuantWeight) -> np.ndarray:
    """What the kernel computes, in float64 after the same fp32 quantization of x: per block
    d = max|x| / 127 and q = rint(x * (127 / max|x|)), then sum over blocks of the dequantized
    block's dot with d * q."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xf).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xf * inv).astype(np.float32)), -127, 127)
    xq = (q * (amax / np.float32(127.0)).astype(np.float32)).astype(np.float64).reshape(x.shape)
    return xq @ w.dequantize().double().numpy().T


@functools.cache
def _bundled_tensors() -> dict:
    from kvfence.model.gguf_loader import open_gguf
    from kvfence.model.loader import default_model_path

    return {t.name: t for t in open_gguf(default_model_path()).tensors}


def real_weight(name: str, rows: int | None = None) -> QuantWeight:
    t = _bundled_tensors()[name]
    data = np.asarray(t.data)[:rows]
    return QuantWeight(int(t.tensor_type), data.shape[0], int(t.shape[0]), data)


@needs_native
@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("m,n,k", [(1, 32, 32), (7, 100, 96), (13, 70, 160), (6, 33, 64), (32, 576, 576)])
def test_qgemm_is_its_arithmetic_exactly(ggml_type, m, n, k):
    """Rows off the 6-row tile, columns off the 32-column panel: to fp32 rounding of the emulation."""
    w = random_weight(ggml_type, n, k)
    x = bf16_rows(m, k)
    got = K.qlinear(x, K.qpack(ggml_type, w.blocks, n, k), n, out_dtype=torch.float32)
    want = emulate(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@needs_native
@pytest.mark.parametrize("name,rows", [("blk.0.attn_q.weight", None), ("blk.5.ffn_down.weight", None),
                                       ("token_embd.weight", 3000)])
def test_qgemm_on_the_bundled_models_blocks_follows_the_float32_matmul(name, rows):
    """Q4_1 layers and the Q8_0 embeddings (the tied LM head): exact to the emulation, and
    within the int8 activations' error (~0.5% in norm) of the dequantized float32 product."""
    w = real_weight(name, rows)
    x = bf16_rows(5, w.cols)
    packed = K.qpack(w.ggml_type, w.blocks, w.rows, w.cols)
    got = K.qlinear(x, packed, w.rows, out_dtype=torch.float32).double()
    want = emulate(x, w)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    dense = x.double() @ w.dequantize().double().T
    assert ((got - dense).norm() / dense.norm()).item() < 0.02
    bf16_out = K.qlinear(x, packed, w.rows)
    assert bf16_out.dtype == torch.bfloat16
    torch.testing.assert_close(bf16_out.float(), got.float(), rtol=8e-3, atol=1e-3)


@needs_native
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("m,inter,k", [(1, 16, 32), (9, 50, 64), (32, 1536, 576)])
def test_gated_qgemm_is_the_two_matmuls_then_the_activation(ggml_type, m, inter, k):
    """Bit for bit: gate and up computed as plain panels, each rounded to bf16, then silu * up."""
    gate, up = random_weight(ggml_type, inter, k, 2), random_weight(ggml_type, inter, k, 3)
    x = bf16_rows(m, k)
    fused = K.qlinear(x, K.qpack(ggml_type, gate.blocks, inter, k, up.blocks), inter, swiglu=True)
    g = K.qlinear(x, K.qpack(ggml_type, gate.blocks, inter, k), inter)
    u = K.qlinear(x, K.qpack(ggml_type, up.blocks, inter, k), inter)
    assert torch.equal(fused, K.silu_mul(torch.cat([g, u], 1)))


@needs_native
def test_qgemm_reads_rows_through_their_stride():
    w = random_weight(Q4_1, 40, 64)
    packed = K.qpack(Q4_1, w.blocks, 40, 64)
    wide = bf16_rows(9, 100)
    x = wide[:, 10:74]
    assert torch.equal(K.qlinear(x, packed, 40), K.qlinear(x.contiguous(), packed, 40))
    assert K.qlinear(x[:0], packed, 40).shape == (0, 40)


def test_qgemm_refuses_calls_that_do_not_match_the_packed_weight():
    """The C side checks n, k, the size and the kind against the packing's header (no read)."""
    w = random_weight(Q4_1, 40, 64)
    packed = K.qpack(Q4_1, w.blocks, 40, 64)
    gated = K.qpack(Q4_1, w.blocks, 40, 64, w.blocks)
    x = bf16_rows(3, 64)
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, packed, 41)                        # wrong n
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(bf16_rows(3, 96), packed, 40)         # wrong k: would read past the weight
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, packed[:-1].clone(), 40)           # truncated
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, gated, 40)                         # gated panels as plain ones
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, packed, 40, swiglu=True)           # and the other way
    assert K.lib.kvfence_qpack_size(Q4_1, 1 << 40, 64, 0) == -1   # a size product that would overflow
    bad = packed.clone()
    bad[0] ^= 1                                          # not a packing (magic)
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, bad, 40)
    bad = packed.clone()
    bad[8] += 1                                          # a header for another n
    with pytest.raises(ValueError, match="does not match"):
        K.qlinear(x, bad, 40)
    with pytest.raises(ValueError, match="not the blocks"):
        K.qpack(Q4_1, w.blocks[:, :-1].copy(), 40, 64)  # blocks of another shape
    with pytest.raises(ValueError, match="not one qgemm takes"):
        K.qpack(Q4_1, w.blocks, 40, 48)                 # k not a multiple of 32
    with pytest.raises(ValueError, match="not one qgemm takes"):
        K.qpack(1, w.blocks, 40, 64)                    # F16: not a native type
    with pytest.raises(ValueError, match="up like gate"):
        K.qpack(Q4_1, w.blocks, 40, 64, w.blocks[:20].copy())
    if not K.has_qgemm:  # a call that passes every check is still refused where nothing can compute it
        with pytest.raises(RuntimeError, match="no native"):
            K.qlinear(x, packed, 40)


@needs_native
def test_linear_and_swiglu_take_the_native_matmul_and_dequantize_without_it(monkeypatch):
    from kvfence.kernels import CpuKernels
    from kvfence.model.linear import Linear, SwiGLU

    w = random_weight(Q4_1, 64, 96)
    gate, up = random_weight(Q4_1, 64, 96, 4), random_weight(Q4_1, 64, 96, 5)
    x = bf16_rows(4, 96)
    lin = Linear(w)
    assert lin.backend == "native"
    torch.testing.assert_close(lin(x).double(), torch.from_numpy(emulate(x, w)), rtol=1e-2, atol=1e-2)
    assert Linear(w, float_out=True)(x).dtype == torch.float32
    mlp = SwiGLU(gate, up)
    assert mlp.backend == "native"
    ref = torch.nn.functional.silu(x.float() @ gate.dequantize().T) * (x.float() @ up.dequantize().T)
    assert ((mlp(x).float() - ref).norm() / ref.norm()).item() < 0.03
    # a CPU without a native matmul: the same weights dequantized, through the bf16 paths
    monkeypatch.setattr(CpuKernels, "has_qgemm", property(lambda self: False))
    assert Linear(w).backend != "native" and SwiGLU(gate, up).backend != "native"
    torch.testing.assert_close(Linear(w)(x).float(), x.float() @ w.dequantize().to(torch.bfloat16).float().T,
                               rtol=2e-2, atol=2e-2)


def quantized_tiny_model(layers: int = 2, ggml_type: int = Q4_1):
    """A tiny Llama whose matmul weights are GGUF blocks (hidden 64, head_dim 32, inter 128)."""
    from kvfence.model.llama import LlamaModel
    from kvfence.sim.model import tiny_config, tiny_weights

    cfg = tiny_config(layers=layers, hidden=64, heads=2, kv_heads=1)
    weights = tiny_weights(cfg)
    for lw in weights.layers:
        for f in ("q", "k", "v", "o", "gate", "up", "down"):
            t = getattr(lw, f).numpy()
            setattr(lw, f, QuantWeight(ggml_type, *t.shape, gguf.quants.quantize(t, gguf.GGMLQuantizationType(
                ggml_type))))
        lw.attn_norm, lw.ffn_norm = lw.attn_norm.to(torch.bfloat16), lw.ffn_norm.to(torch.bfloat16)
    e = weights.embed.numpy()
    weights.lm_head = QuantWeight(Q8_0, *e.shape, gguf.quants.quantize(e, gguf.GGMLQuantizationType(Q8_0)))
    weights.embed = weights.lm_head.dequantize(torch.bfloat16)
    weights.final_norm = weights.final_norm.to(torch.bfloat16)
    return LlamaModel(weights)


@needs_native
def test_native_decoder_stack_is_bit_for_bit_the_per_kernel_loop():
    from test_kernels import run_mixed_batch

    model = quantized_tiny_model()
    assert model.stack is not None and model.lm_head.backend == "native"
    assert {m.backend for layer in model.layers for m in (layer[1], layer[2], layer[4], layer[5])} == {"native"}
    stacked, stacked_pool = run_mixed_batch(model, True)
    model.stack = None
    looped, looped_pool = run_mixed_batch(model, True)
    assert torch.equal(stacked_pool, looped_pool)
    assert torch.equal(stacked, looped)


@needs_native
def test_native_decoder_stack_refuses_a_weight_of_another_shape():
    model = quantized_tiny_model()
    stack = model.stack
    # swap layer 1's o for its qkv: the C side finds the header's shape wrong and stops
    layer = stack._layers[1]
    layer.o, layer.o_bytes = layer.qkv, layer.qkv_bytes
    pool = torch.zeros(2, 2, 1, 4 * 8, 32, dtype=torch.bfloat16)
    h = model.embed[torch.arange(3)].float()   # the float32 residual stream
    with pytest.raises(ValueError, match="layer 1's native o matmul"):
        stack.run(h.clone(), positions=torch.arange(3), write_slots=torch.arange(3), cos=model.cos, sin=model.sin,
                  kv=pool, pages=torch.tensor([[1]]), q_start=torch.tensor([0]), q_len=torch.tensor([3]),
                  kv_len=torch.tensor([3]), logits_rows=torch.tensor([2]), page_size=8)


@needs_native
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_a_nan_in_a_row_stays_nan_in_that_rows_output(ggml_type):
    """The poison scrub's NaN sentinel (I7) must survive the native matmul: int8 quantization
    would turn it into INT_MIN and a finite, wrong output. Other rows are untouched."""
    w = random_weight(ggml_type, 40, 96)
    packed = K.qpack(ggml_type, w.blocks, 40, 96)
    x = bf16_rows(4, 96)
    clean = K.qlinear(x, packed, 40, out_dtype=torch.float32)
    x[2, 37] = float("nan")
    got = K.qlinear(x, packed, 40, out_dtype=torch.float32)
    assert torch.isnan(got[2]).all()
    assert torch.equal(got[[0, 1, 3]], clean[[0, 1, 3]])
    assert torch.isnan(K.qlinear(x, packed, 40)[2].float()).all()      # bf16 output too
