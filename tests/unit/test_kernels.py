"""The fused CPU kernels against plain torch: same arithmetic, and attention that reads only
the positions a row may see, through the table it is given."""
from __future__ import annotations

import math
import os

import pytest
import torch

from kvfence.kernels import cpu_kernels
from kvfence.kv.pool import k_pages, v_pages
from kvfence.model.llama import AttentionRows, ForwardBatch, LlamaModel
from kvfence.sim.model import tiny_config, tiny_weights

K = cpu_kernels()
if K is None and os.environ.get("CI"):  # CI has a compiler: kernels that do not build are a failure
    raise RuntimeError("CPU kernels did not build; see the kvfence.kernels warning")
pytestmark = pytest.mark.skipif(K is None, reason="CPU kernels not built on this machine")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(dtype):
    g = gen()
    h = torch.randn(37, 96, generator=g).to(dtype)
    delta = torch.randn(37, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    want_h = h + delta
    xf = want_h.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got_h = h.clone()
    got = K.add_rms_norm(got_h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h)  # the residual add rounds exactly as torch does
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    alone = K.add_rms_norm(want_h.clone(), None, w, 1e-5)
    torch.testing.assert_close(alone, got)


@pytest.mark.parametrize("dim", [96, 100])   # the vector rows and the scalar ones
def test_add_rms_norm_f32res_keeps_the_residual_unrounded(dim):
    """A bf16 model's float32 residual: the add is exact float32 (never rounded to bf16), the
    normed output bf16 as torch computes it from the float32 sum."""
    g = gen()
    h = torch.randn(37, dim, generator=g) * 3
    delta = torch.randn(37, dim, generator=g).to(torch.bfloat16)
    w = torch.randn(dim, generator=g).to(torch.bfloat16)
    want_h = h + delta.float()
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got_h = h.clone()
    got = K.add_rms_norm_f32res(got_h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h) and not torch.equal(got_h, want_h.to(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(K.add_rms_norm_f32res(want_h.clone(), None, w, 1e-5), got)
    with pytest.raises(ValueError, match="float32"):
        K.add_rms_norm_f32res(h.to(torch.bfloat16), delta, w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gu = (torch.randn(19, 2 * 80, generator=gen(1)) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(K.silu_mul(gu).float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_silu_mul_vector_lanes_are_the_scalar_tail_bit_for_bit():
    """SIMD builds run a row's SiLU a vector of 8 (or 16) lanes at a time and its last columns
    one at a time; each column alone (inter 1) takes the scalar path. Equal bits for every
    column, NaN and infinities included, mean the lanes follow the scalar arithmetic exactly,
    so the gated matmul's epilogue (vector lanes per 24-column panel) and kvfence_silu_mul agree
    wherever a row's columns split between the two."""
    inter = 37
    gu = (torch.randn(23, 2 * inter, generator=gen(3)) * 6).to(torch.bfloat16)
    gu[0, 0], gu[1, 3], gu[2, inter + 5], gu[3, 1] = float("nan"), float("inf"), float("nan"), -float("inf")
    gu[4, :inter] = torch.linspace(-95, 95, inter)   # past exp's clamps on both sides
    whole = K.silu_mul(gu)
    for c in range(inter):
        alone = K.silu_mul(torch.stack([gu[:, c], gu[:, inter + c]], dim=1).contiguous())
        assert torch.equal(whole[:, c:c + 1].view(torch.int16), alone.view(torch.int16)), c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,dim", [(16, 64), (8, 32)])  # the compiled fast shape and the general path
def test_rope_store_matches_torch(dtype, page_size, dim):
    g = gen(2)
    heads, kv_heads, n, pages = 6, 2, 11, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    pos_table = torch.randn(64, dim, generator=g)
    cos, sin = pos_table.cos().to(dtype), pos_table.sin().to(dtype)
    positions = torch.randint(0, 64, (n,), generator=g)
    slots = torch.randperm(pages * page_size, generator=g)[:n]
    k_cache = torch.zeros(kv_heads, pages * page_size, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    want_qk = LlamaModel._rotate(qkv[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim),
                                 cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    LlamaModel._store(want_k, want_v, want_qk[:, heads:], qkv[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim),
                      slots, page_size)
    got = qkv.clone()
    K.rope_store(got, heads, kv_heads, dim, positions, cos, sin, k_cache, v_cache, slots, page_size)
    # bf16: bit for bit (the same roundings); fp32: the kernel may fuse a multiply-add
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, :(heads + kv_heads) * dim].view_as(want_qk), want_qk, **tol)
    torch.testing.assert_close(k_cache, want_k, **tol)
    assert torch.equal(v_cache, want_v)


def reference_attention(q, k_cache, v_cache, pages, q_start, q_len, kv_len, page_size):
    """Dense float64 attention over each row's pages, positions read through the same table."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    kp = k_pages(k_cache.double(), page_size)   # the pool's paired in-page layout
    vp = v_pages(v_cache.double(), page_size)
    for r in range(len(q_start)):
        t = int(kv_len[r])
        pos = torch.arange(t)
        pg, j = pages[r][pos // page_size], pos % page_size
        keys = kp[:, pg, :, j, :].reshape(t, kv_heads, dim)          # [t, kv_heads, dim]
        vals = vp[:, pg, j // 2, :, j % 2]                           # [t, kv_heads, dim]
        for i in range(int(q_len[r])):
            row = int(q_start[r]) + i
            seen = t - int(q_len[r]) + i + 1
            for h in range(heads):
                kh = h // group
                s = keys[:seen, kh] @ q[row, h].double() / math.sqrt(dim)
                out[row, h] = torch.softmax(s, 0) @ vals[:seen, kh]
    return out


def attention_case(dtype, page_size, dim, seed=3):
    """A batch like the runner's: decodes with long contexts, a fresh prefill, and a prefill
    continuing over cached context; pages shuffled over the pool."""
    g = gen(seed)
    heads, kv_heads, num_pages = 6, 2, 60
    rows = [(1, 37), (1, 5), (1, 1), (13, 13), (9, 40), (45, 70)]  # (q_len, kv_len); 45: two query blocks
    q_len = torch.tensor([r[0] for r in rows])
    kv_len = torch.tensor([r[1] for r in rows])
    q_start = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), q_len[:-1]]), 0)
    width = max(-(-r[1] // page_size) for r in rows) + 1
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    pages = torch.zeros(len(rows), width, dtype=torch.int64)  # padding: the null page 0
    used = 0
    for r, (_, t) in enumerate(rows):
        need = -(-t // page_size)
        pages[r, :need] = perm[used:used + need]
        used += need
    n = int(q_len.sum())
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    k_cache = torch.randn(kv_heads, num_pages * page_size, dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages * page_size, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, pages, q_start, q_len, kv_len


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,dim", [(16, 64), (8, 32), (4, 8)])
def test_paged_attention_matches_dense_reference(dtype, page_size, dim):
    q, kc, vc, pages, qs, ql, kl = attention_case(dtype, page_size, dim)
    out = torch.empty_like(q)
    K.paged_attention(q, kc, vc, pages, qs, ql, kl, out, page_size, dim ** -0.5)
    want = reference_attention(q, kc, vc, pages, qs, ql, kl, page_size)
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("page_size,dim", [(16, 64), (8, 32)])
@pytest.mark.parametrize("dtype", DTYPES)  # bf16 16 x 64: the pair-product path, odd key counts included
def test_paged_attention_reads_nothing_a_row_may_not_see(page_size, dim, dtype):
    """NaN everywhere a row may not read: past its kv_len on its own last page (also the
    other half of a V pair it does read), on the null page, and on every page outside its
    table. One stray read would make its output NaN."""
    q, kc, vc, pages, qs, ql, kl = attention_case(dtype, page_size, dim)
    allowed = torch.zeros(kc.shape[1], dtype=torch.bool)
    for r in range(len(qs)):
        pos = torch.arange(int(kl[r]))
        allowed[pages[r][pos // page_size] * page_size + pos % page_size] = True
    slot_ok = allowed.view(-1, page_size)
    k_pages(kc, page_size).masked_fill_(~slot_ok[None, :, None, :, None], math.nan)
    v_pages(vc, page_size).masked_fill_(~slot_ok.view(-1, page_size // 2, 2)[None, :, :, None, :], math.nan)
    out = torch.empty_like(q)
    K.paged_attention(q, kc, vc, pages, qs, ql, kl, out, page_size, dim ** -0.5)
    assert not out.isnan().any()


def test_paged_attention_refuses_tables_outside_the_pool():
    q, kc, vc, pages, qs, ql, kl = attention_case(torch.float32, 16, 64)
    num_pages = kc.shape[1] // 16
    for bad in (num_pages, -1):
        p = pages.clone()
        p[1, 0] = bad
        with pytest.raises(IndexError, match="row 1"):
            K.paged_attention(q, kc, vc, p, qs, ql, kl, torch.empty_like(q), 16, 0.125)
    short = kl.clone()
    short[3] = ql[3] - 1  # fewer keys than its own new tokens
    with pytest.raises(IndexError, match="row 3"):
        K.paged_attention(q, kc, vc, pages, qs, ql, short, torch.empty_like(q), 16, 0.125)
    long = kl.clone()
    long[0] = pages.shape[1] * 16 + 1  # more keys than its table has pages
    with pytest.raises(IndexError, match="row 0"):
        K.paged_attention(q, kc, vc, pages, qs, ql, long, torch.empty_like(q), 16, 0.125)
    past = qs.clone()
    past[4] = q.shape[0] - int(ql[4]) + 1  # its queries (and outputs) would run past the batch
    with pytest.raises(IndexError, match="row 4"):
        K.paged_attention(q, kc, vc, pages, past, ql, kl, torch.empty_like(q), 16, 0.125)


@pytest.mark.parametrize("field,bad", [("slot", -1), ("slot", 5 * 16), ("position", 64), ("position", -1)])
def test_rope_store_refuses_slots_outside_the_pool_and_writes_nothing(field, bad):
    g = gen(12)
    heads, kv_heads, dim, n = 6, 2, 64, 7
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    table = torch.randn(64, dim, generator=g)
    cos, sin = table.cos().to(torch.bfloat16), table.sin().to(torch.bfloat16)
    positions, slots = torch.arange(n), torch.arange(n) * 3
    (slots if field == "slot" else positions)[5] = bad
    k_cache = torch.zeros(kv_heads, 5 * 16, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    before = qkv.clone()
    with pytest.raises(IndexError, match="token 5"):
        K.rope_store(qkv, heads, kv_heads, dim, positions, cos, sin, k_cache, v_cache, slots, 16)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()  # checked before any write


def test_wrappers_refuse_layouts_the_kernels_do_not_take():
    h = torch.randn(4, 64)
    with pytest.raises(ValueError, match="add_rms_norm"):
        K.add_rms_norm(h.t().contiguous().t(), None, torch.ones(64), 1e-5)   # columns, not rows, contiguous
    with pytest.raises(ValueError, match="add_rms_norm"):
        K.add_rms_norm(h, None, torch.ones(32), 1e-5)                       # a weight of the wrong size
    with pytest.raises(ValueError, match="argmax_rows"):
        K.argmax_rows(torch.randn(4, 64).to(torch.bfloat16))


def tiny_model(dtype, layers=2, head_dim=32):  # head_dim 32: the general kernel path
    cfg = tiny_config(layers=layers, hidden=4 * head_dim, heads=4, kv_heads=2)
    w = tiny_weights(cfg, seed=4)
    for lw in w.layers:
        for f in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "ffn_norm"):
            setattr(lw, f, getattr(lw, f).to(dtype))
    w.embed, w.final_norm = w.embed.to(dtype), w.final_norm.to(dtype)
    return LlamaModel(w, "cpu")


def run_mixed_batch(model, fused):
    """Row 0 decodes at position 20 (its pages 1-3 hold positions 0..19), row 1 is a fresh
    6-token prefill on page 4. Returns (logits, pool after the pass)."""
    cfg, ps = model.config, 8
    q_len, kv_len = torch.tensor([1, 6]), torch.tensor([21, 6])
    pages = torch.tensor([[1, 2, 3], [4, 0, 0]])
    positions = torch.cat([torch.tensor([20]), torch.arange(6)])
    write_slots = torch.cat([torch.tensor([3 * ps + 4]), 4 * ps + torch.arange(6)])
    batch = ForwardBatch(torch.randint(0, cfg.vocab_size, (7,), generator=gen(5)), positions, write_slots,
                         AttentionRows(torch.tensor([0, 1]), q_len, kv_len, pages), torch.tensor([0, 6]), ps)
    pool = torch.randn(cfg.num_layers, 2, cfg.num_kv_heads, 6 * ps, cfg.head_dim, generator=gen(6)).to(model.dtype)
    return model.forward(batch, pool, fused=fused), pool


def test_model_forward_fused_equals_torch_path_fp32():
    """The whole decoder stack, one mixed batch, both implementations from the same pool."""
    model = tiny_model(torch.float32)
    fused, fused_pool = run_mixed_batch(model, True)
    plain, plain_pool = run_mixed_batch(model, False)
    torch.testing.assert_close(fused_pool, plain_pool, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_model_forward_fused_bf16_is_as_accurate_as_torch_path():
    """In bf16 the two paths round differently (the torch path rounds attention scores to
    bf16; the kernel keeps them in fp32): both are held to the fp32 result, and the fused
    one must be at least as close."""
    exact, _ = run_mixed_batch(tiny_model(torch.float32), True)
    model = tiny_model(torch.bfloat16)
    fused, fused_pool = run_mixed_batch(model, True)
    plain, plain_pool = run_mixed_batch(model, False)
    assert torch.equal(fused_pool[0], plain_pool[0])  # layer 0: the same K and V in the same slots
    err_fused = (fused - exact).abs().max().item()
    err_plain = (plain - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert err_fused <= max(err_plain * 1.1, 0.02 * scale), (err_fused, err_plain, scale)


@pytest.mark.skipif(K is None or not K.has_gemm, reason="no bf16 matmul (AVX512-BF16 or AVX2) in this build")
@pytest.mark.parametrize("head_dim", [32, 64])  # the general attention path and the 16 x 64 one
def test_decoder_stack_is_bit_for_bit_the_per_kernel_loop(head_dim):
    """stack.cpp runs the same kernels in the same order as LlamaModel._layers_fused: the
    same logits and the same pool, to the bit."""
    model = tiny_model(torch.bfloat16, layers=3, head_dim=head_dim)
    assert model.stack is not None
    stacked, stacked_pool = run_mixed_batch(model, True)
    model.stack = None
    looped, looped_pool = run_mixed_batch(model, True)
    assert torch.equal(stacked_pool, looped_pool)
    assert torch.equal(stacked, looped)


@pytest.mark.skipif(K is None or not K.has_gemm, reason="no bf16 matmul (AVX512-BF16 or AVX2) in this build")
def test_decoder_stack_refuses_what_its_kernels_refuse():
    model = tiny_model(torch.bfloat16)
    pool = torch.zeros(2, 2, 2, 4 * 8, 32, dtype=torch.bfloat16)
    h = model.embed[torch.arange(3)].float()   # the float32 residual stream
    args = dict(positions=torch.arange(3), write_slots=torch.arange(3), cos=model.cos, sin=model.sin, kv=pool,
                pages=torch.tensor([[1]]), q_start=torch.tensor([0]), q_len=torch.tensor([3]),
                kv_len=torch.tensor([3]), logits_rows=torch.tensor([2]), page_size=8)
    assert model.stack.run(h.clone(), **args).shape == (1, 128)
    with pytest.raises(IndexError, match="token 1"):
        model.stack.run(h.clone(), **{**args, "write_slots": torch.tensor([0, 4 * 8, 1])})
    with pytest.raises(IndexError, match="row 0"):
        model.stack.run(h.clone(), **{**args, "pages": torch.tensor([[4]])})
    with pytest.raises(IndexError, match="logits row 3"):
        model.stack.run(h.clone(), **{**args, "logits_rows": torch.tensor([3])})
    with pytest.raises(ValueError, match="decoder_stack"):
        model.stack.run(h.clone(), **{**args, "kv": pool.float()})


# -- bf16 matmul (gemm.cpp) -------------------------------------------------------------------
gemm_only = pytest.mark.skipif(K is None or not K.has_gemm, reason="no bf16 matmul (AVX512-BF16 or AVX2) in this build")


@gemm_only
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (13, 100, 64), (32, 960, 576), (25, 70, 18), (40, 33, 2)])
def test_gemm_matches_float64_reference(m, n, k):
    """Row counts off the 8-row tile, widths off the 48-column panel (masked stores)."""
    g = gen(7)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = K.linear(x, K.pack_weight(w), n)
    want = (x.double() @ w.double().T)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # fp32 sums of exact products, one rounding to bf16: within bf16's half-ulp plus fp32 noise
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-3 * math.sqrt(k))


@gemm_only
@pytest.mark.parametrize("swiglu,out_dtype", [(False, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16)])
def test_gemm_row_is_the_same_whatever_else_is_in_the_batch(swiglu, out_dtype):
    """A row's result is bit for bit the same alone or among 1..33 other rows, whatever tile
    shape it lands in: a request's logits (and so its greedy or seeded tokens) cannot depend on
    the other requests in the step."""
    g = gen(11)
    w = torch.randn(100, 576, generator=g).to(torch.bfloat16)
    packed = K.pack_weight(w, torch.randn(100, 576, generator=g).to(torch.bfloat16) if swiglu else None)
    rows = torch.randn(34, 576, generator=g).to(torch.bfloat16)
    alone = [K.linear(rows[i:i + 1], packed, 100, swiglu=swiglu, out_dtype=out_dtype) for i in range(len(rows))]
    for m in (2, 3, 4, 5, 7, 32, 34):
        for start in range(0, len(rows) - m + 1, max(1, m // 2)):
            got = K.linear(rows[start:start + m], packed, 100, swiglu=swiglu, out_dtype=out_dtype)
            for i in range(m):
                assert torch.equal(got[i:i + 1], alone[start + i]), (m, start, i)


@gemm_only
def test_gemm_reads_rows_through_their_stride_and_nothing_past_n():
    g = gen(8)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    wide = torch.randn(9, 100, generator=g).to(torch.bfloat16)
    x = wide[:, 10:74]                       # rows 100 apart: the kernel must use the stride
    got = K.linear(x, K.pack_weight(w), 40)
    torch.testing.assert_close(got, K.linear(x.contiguous(), K.pack_weight(w), 40), rtol=0, atol=0)
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)
    assert K.linear(x[:0], K.pack_weight(w), 40).shape == (0, 40)


@gemm_only
def test_linear_uses_the_kvfence_matmul_for_bf16_and_falls_back_for_odd_k():
    from kvfence.model.linear import Linear
    w = torch.randn(48, 64, generator=gen(9)).to(torch.bfloat16)
    lin = Linear(w)
    assert lin.backend == "kvfence"
    x = torch.randn(5, 64, generator=gen(10)).to(torch.bfloat16)
    torch.testing.assert_close(lin(x).float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=5e-2)
    assert Linear(torch.randn(48, 63).to(torch.bfloat16)).backend != "kvfence"
    assert Linear(torch.randn(48, 64)).backend == "torch"   # float32 stays on F.linear


@gemm_only
@pytest.mark.parametrize("m,inter,k", [(1, 24, 32), (13, 50, 64), (32, 1536, 576), (9, 7, 6), (17, 40, 18)])
def test_gated_gemm_is_the_matmul_then_the_activation(m, inter, k):
    """One pass with silu(gate) * up in the epilogue: bit for bit the matmul's bf16 product
    followed by the activation kernel, and close to a float64 reference. Widths off the
    24-column gated panel check the masked stores (nothing written past inter)."""
    g = gen(12)
    gate = torch.randn(inter, k, generator=g).to(torch.bfloat16)
    up = torch.randn(inter, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = K.linear(x, K.pack_weight(gate, up), inter, swiglu=True)
    assert got.shape == (m, inter)
    two_step = K.silu_mul(K.linear(x, K.pack_weight(torch.cat([gate, up])), 2 * inter))
    assert torch.equal(got, two_step)
    gu = (x.double() @ torch.cat([gate, up]).double().T).to(torch.bfloat16).double()
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * math.sqrt(k))


@gemm_only
def test_swiglu_takes_the_gated_matmul_for_bf16_and_the_two_step_path_otherwise():
    from kvfence.model.linear import SwiGLU
    g = gen(13)
    gate, up = torch.randn(2, 40, 64, generator=g).to(torch.bfloat16).float()  # exact in bf16
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16).float()
    want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    fused = SwiGLU(gate.to(torch.bfloat16), up.to(torch.bfloat16))
    assert fused.backend == "kvfence" and fused.gate_up is None
    torch.testing.assert_close(fused(x.to(torch.bfloat16)).float(), want, rtol=2e-2, atol=5e-2)
    plain = SwiGLU(gate, up)  # float32: F.linear, then the activation
    assert plain.backend == "torch" and plain.gated is None
    torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)


def test_argmax_rows_is_torch_argmax_ties_nan_and_inf_included():
    g = gen(11)
    x = torch.randn(9, 1000, generator=g)
    x[1, 17] = x[1, 900] = 50.0                 # a tie: the first index wins
    x[2, 3] = float("nan")                      # NaN counts as the largest, first one wins
    x[2, 500] = float("nan")
    x[3, :] = float("-inf")                     # all -inf: index 0
    x[4, 999] = float("inf")                    # the tail past the last 16 lanes
    x[5, :] = 7.0                               # all equal: index 0
    x[6, 995] = 100.0                           # the max in the scalar tail
    x[7, 999] = float("nan")                    # a NaN only in the tail
    got = K.argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    odd = torch.randn(3, 5, generator=g)        # shorter than one vector
    assert K.argmax_rows(odd).tolist() == odd.argmax(dim=-1).tolist()
