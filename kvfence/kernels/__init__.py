"""Fused CPU kernels for the model's hot path, with tensor-level wrappers.

`cpu_kernels()` returns the kernels, or None when they are switched off
(KVFENCE_KERNELS=0) or cannot be built here; the model then uses plain torch ops, which
compute the same thing more slowly (tests/unit/test_kernels.py holds both to each other).
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger("kvfence.kernels")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_UNSET = object()
_cached = _UNSET


def enabled_by_env() -> bool:
    return os.environ.get("KVFENCE_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


def cpu_kernels() -> CpuKernels | None:
    """The process's kernels (built or loaded on first call), or None."""
    global _cached
    if _cached is _UNSET:
        _cached = None
        if enabled_by_env():
            try:
                from kvfence.kernels.build import load_library
                _cached = CpuKernels(load_library())
            except Exception as e:  # noqa: BLE001 - no compiler, failed build: slower, still correct
                log.warning("CPU kernels unavailable, using plain torch ops (slower): %s (they are compiled into "
                            "$KVFENCE_CACHE_DIR, else $XDG_CACHE_HOME/kvfence or ~/.cache/kvfence: a folder this "
                            "user can write)", e)
    return _cached


MAX_PAGE_SIZE, MAX_HEAD_DIM = 64, 256   # the attention kernel's bounds (kMaxPage, kMaxDim)


def supports(dtype: torch.dtype, device: str | torch.device, head_dim: int) -> bool:
    return torch.device(device).type == "cpu" and dtype in _DTYPE_CODES and head_dim <= MAX_HEAD_DIM


def _require(ok: bool, what: str) -> None:
    """A wrapper's precondition: the C++ side trusts these, so they hold under python -O too."""
    if not ok:
        raise ValueError(f"CPU kernel call: {what}")


class CpuKernels:
    """Thin wrappers: they check what the C++ side assumes (dtype, device, row-contiguity,
    shapes) and pass pointers; the C++ side checks every index it is given (pool slots and
    pages, positions, query rows) before it reads or writes anything. Threads: torch's count,
    from torch's OpenMP pool."""

    def __init__(self, lib):
        self.lib = lib
        self._sizes: dict[tuple[int, int], int] = {}

    @staticmethod
    def _code(t: torch.Tensor) -> int:
        code = _DTYPE_CODES.get(t.dtype)
        if code is None or t.device.type != "cpu":
            raise TypeError(f"CPU kernels take float32/bfloat16 CPU tensors, got {t.dtype} on {t.device}")
        return code

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """h += delta in place (when given); returns weight * rmsnorm(h)."""
        n, dim = h.shape
        _require(h.is_contiguous() and weight.is_contiguous() and weight.dtype == h.dtype
                 and weight.shape == (dim,), "add_rms_norm: h [n, dim] contiguous, weight [dim] of its dtype")
        if delta is not None:
            _require(delta.shape == h.shape and delta.is_contiguous() and delta.dtype == h.dtype,
                     "add_rms_norm: delta like h")
        out = torch.empty_like(h) if out is None else out
        _require(out.shape == h.shape and out.is_contiguous() and out.dtype == h.dtype, "add_rms_norm: out like h")
        self.lib.kvfence_add_rms_norm(self._code(h), h.data_ptr(), None if delta is None else delta.data_ptr(),
                                      weight.data_ptr(), out.data_ptr(), n, dim, eps, torch.get_num_threads())
        return out

    def add_rms_norm_f32res(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
        """A bf16 model's float32 residual stream h [n, dim]: h += delta (bf16) in place, without
        rounding h; returns weight * rmsnorm(h) in bf16."""
        n, dim = h.shape
        bf16 = torch.bfloat16
        _require(h.dtype == torch.float32 and h.is_contiguous() and h.device.type == "cpu"
                 and weight.is_contiguous() and weight.dtype == bf16 and weight.shape == (dim,),
                 "add_rms_norm_f32res: h [n, dim] float32 contiguous, weight [dim] bf16")
        if delta is not None:
            _require(delta.shape == h.shape and delta.is_contiguous() and delta.dtype == bf16,
                     "add_rms_norm_f32res: delta [n, dim] bf16")
        out = torch.empty(n, dim, dtype=bf16) if out is None else out
        _require(out.shape == h.shape and out.is_contiguous() and out.dtype == bf16, "add_rms_norm_f32res: out bf16")
        self.lib.kvfence_add_rms_norm_f32res(h.data_ptr(), None if delta is None else delta.data_ptr(),
                                             weight.data_ptr(), out.data_ptr(), n, dim, eps, torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, page_size: int) -> None:
        """Rotate q and k of qkv [n, (heads + 2*kv_heads) * dim] in place and store k, v at
        the given pool slots (k_cache, v_cache: one layer's [kv_heads, slots, dim])."""
        n = qkv.shape[0]
        _require(qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim, "rope_store: qkv rows")
        _require(k_cache.is_contiguous() and k_cache.shape == v_cache.shape and v_cache.is_contiguous()
                 and k_cache.shape[0] == kv_heads and k_cache.shape[2] == dim and k_cache.shape[1] % page_size == 0
                 and k_cache.dtype == qkv.dtype == v_cache.dtype, "rope_store: caches [kv_heads, slots, dim]")
        for t in (positions, slots):
            _require(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (n,), "rope_store: [n] int64 indices")
        _require(cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] == dim
                 and cos.dtype == qkv.dtype == sin.dtype, "rope_store: cos/sin [positions, dim]")
        rc = self.lib.kvfence_rope_store(self._code(qkv), qkv.data_ptr(), n, qkv.stride(0), heads, kv_heads, dim,
                                         positions.data_ptr(), cos.shape[0], cos.data_ptr(), sin.data_ptr(),
                                         k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), slots.data_ptr(),
                                         page_size, torch.get_num_threads())
        if rc != 0:
            raise IndexError(_rope_store_refused(rc))

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gu = [gate | up] along the last dimension."""
        n, two_i = gu.shape
        _require(gu.is_contiguous() and two_i % 2 == 0, "silu_mul: gu [n, 2*inter] contiguous")
        out = torch.empty(n, two_i // 2, dtype=gu.dtype)
        self.lib.kvfence_silu_mul(self._code(gu), gu.data_ptr(), out.data_ptr(), n, two_i // 2,
                                  torch.get_num_threads())
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a [rows, cols] float32 tensor: the first index on ties,
        a NaN counts as the largest. torch's is single-threaded and scalar; a greedy decode step
        runs it over 32 x 49152 logits."""
        rows, cols = x.shape
        _require(x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and cols > 0,
                 "argmax_rows: [rows, cols>0] float32, contiguous, CPU")
        out = torch.empty(rows, dtype=torch.int64)
        self.lib.kvfence_argmax_rows(x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out

    def apply_token_mask(self, x: torch.Tensor, rows: torch.Tensor, mask) -> None:
        """In place: -inf on x[rows[i], t] for every token t whose bit in mask[i] (llguidance's
        int32 bitmask, [len(rows), words]) is 0, and on every column past 32 * words. One pass
        over the mask that skips words of allowed tokens; the 0/-inf bias it replaces took three
        passes over the logits."""
        import numpy as np

        n_x, cols = x.shape
        _require(x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous(),
                 "apply_token_mask: x [rows, cols] float32, contiguous, CPU")
        _require(rows.dtype == torch.int64 and rows.is_contiguous() and rows.dim() == 1,
                 "apply_token_mask: rows int64, contiguous")
        _require(isinstance(mask, np.ndarray) and mask.dtype == np.int32 and mask.ndim == 2
                 and mask.flags["C_CONTIGUOUS"] and mask.shape[0] == rows.numel(),
                 "apply_token_mask: mask int32 [len(rows), words], C-contiguous")
        rc = self.lib.kvfence_apply_token_mask(x.data_ptr(), n_x, cols, rows.data_ptr(), rows.numel(),
                                               mask.ctypes.data, mask.shape[1], torch.get_num_threads())
        _require(rc == 0, "apply_token_mask: a row index outside x")

    # -- bf16 matmul (gemm.cpp) ------------------------------------------------------------
    @property
    def has_gemm(self) -> bool:
        """Whether this build has kvfence's bf16 matmul (AVX512-BF16, or AVX2 + FMA)."""
        return bool(self.lib.kvfence_gemm_supported())

    @property
    def gemm_isa(self) -> str:
        """Which bf16 matmul this build runs: avx512-bf16, avx2, or none."""
        return {2: "avx512-bf16", 1: "avx2"}.get(self.lib.kvfence_gemm_supported(), "none")

    @property
    def qgemm_isa(self) -> str:
        """Which native (GGUF blocks) matmul this build runs: avx512-vnni, avx2, or none."""
        return {1: "avx512-vnni", 2: "avx2"}.get(self.lib.kvfence_qgemm_supported(), "none")

    def _packed_size(self, n: int, k: int, gated: bool) -> int:
        size = self._sizes.get((n, k, gated))
        if size is None:
            size_of = self.lib.kvfence_gemm_gated_packed_size if gated else self.lib.kvfence_gemm_packed_size
            size = self._sizes[(n, k, gated)] = size_of(n, k)
        return size

    def pack_weight(self, weight: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """A bf16 weight [N, K] (K even) in the matmul's panel layout; given up (also [N, K]),
        weight is a gate and the two go into the gated panels `linear(..., swiglu=True)` takes."""
        n, k = weight.shape
        for w in (weight, up):
            _require(w is None or (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape == (n, k)
                                   and k % 2 == 0), "pack_weight: bf16 CPU [N, K], K even (up like weight)")
        packed = torch.empty(self._packed_size(n, k, up is not None), dtype=torch.int32)
        weight = weight.contiguous()
        if up is None:
            self.lib.kvfence_gemm_pack(weight.data_ptr(), n, k, packed.data_ptr())
        else:
            up = up.contiguous()
            self.lib.kvfence_gemm_pack_gated(weight.data_ptr(), up.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, swiglu: bool = False,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times the packed [N, K] weight, transposed: [M, N].
        swiglu: packed holds gated panels; returns silu(x . gate^T) * (x . up^T), [M, N].
        out_dtype float32: the float32 sums as they are (the LM head's logits), not rounded to bf16."""
        m, k = x.shape
        _require(x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1 and x.stride(0) >= k,
                 "linear: x bf16 CPU, rows contiguous")
        _require(k % 2 == 0 and packed.numel() == self._packed_size(n, k, swiglu), "linear: packed weight of [n, k]")
        _require(out_dtype == torch.bfloat16 or (out_dtype == torch.float32 and not swiglu),
                 "linear: out_dtype bfloat16, or float32 for plain panels")
        out = torch.empty(m, n, dtype=out_dtype)
        if m:
            gemm = (self.lib.kvfence_gemm_swiglu if swiglu
                    else self.lib.kvfence_gemm_f32 if out_dtype == torch.float32 else self.lib.kvfence_gemm)
            rc = gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n, m, n, k, torch.get_num_threads())
            if rc != 0:
                raise RuntimeError("this build of the CPU kernels has no bf16 (or native) matmul")
        return out

    # -- native GGUF weights (qgemm.cpp) -----------------------------------------------------
    @property
    def has_qgemm(self) -> bool:
        """Whether this build has an integer matmul over GGUF blocks (AVX512-VNNI or AVX2)."""
        return bool(self.lib.kvfence_qgemm_supported())

    def qpack(self, ggml_type: int, blocks, n: int, k: int, up=None) -> torch.Tensor:
        """GGUF blocks (uint8 numpy [n, row bytes]) of an [n, k] weight in qgemm's layout, a
        uint8 tensor that starts with a header of its type and shape; given up's blocks too,
        gated panels of gate (blocks) and up for `qlinear(..., swiglu=True)`."""
        import numpy as np

        for b in (blocks, up):
            _require(b is None or (isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.flags["C_CONTIGUOUS"]),
                     "qpack: blocks uint8, C-contiguous")
        size = self.lib.kvfence_qpack_size(ggml_type, n, k, int(up is not None))
        _require(size > 0, f"qpack: ggml type {ggml_type} [{n}, {k}] is not one qgemm takes")
        _require(up is None or up.nbytes == blocks.nbytes, "qpack: up like gate")
        out = torch.empty(size, dtype=torch.uint8)
        rc = self.lib.kvfence_qpack(ggml_type, blocks.ctypes.data, None if up is None else up.ctypes.data,
                                    blocks.nbytes, n, k, out.data_ptr(), size)
        _require(rc == 0, f"qpack: {blocks.nbytes} bytes are not the blocks of a ggml type {ggml_type} [{n}, {k}]")
        return out

    def qlinear(self, x: torch.Tensor, packed: torch.Tensor, n: int, swiglu: bool = False,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times the packed [N, K] weight, transposed: [M, N],
        as linear() does for bf16 panels. The C side checks N, K and the packing's size and kind
        against the packed weight's header and refuses (ValueError) a call that does not match."""
        m, k = x.shape
        _require(x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1 and x.stride(0) >= k,
                 "qlinear: x bf16 CPU, rows contiguous")
        _require(packed.dtype == torch.uint8 and packed.is_contiguous(), "qlinear: packed uint8, contiguous")
        _require(out_dtype == torch.bfloat16 or (out_dtype == torch.float32 and not swiglu),
                 "qlinear: out_dtype bfloat16, or float32 for plain panels")
        out = torch.empty(m, n, dtype=out_dtype)
        gemm = (self.lib.kvfence_qgemm_swiglu if swiglu
                else self.lib.kvfence_qgemm_f32 if out_dtype == torch.float32 else self.lib.kvfence_qgemm)
        rc = gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), packed.numel(), out.data_ptr(), n, m, n, k,
                  torch.get_num_threads())
        if rc == -2:
            raise RuntimeError("this build of the CPU kernels has no native (VNNI or AVX2) matmul")
        _require(rc == 0, f"qlinear: x [{m}, {k}] -> [{m}, {n}] does not match the packed weight")
        return out

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                        q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor, out: torch.Tensor,
                        page_size: int, scale: float) -> None:
        """q [n, heads, dim] (token stride free); out [n, heads, dim] contiguous; pages
        [rows, P] int64; q_start/q_len/kv_len [rows] int64. Raises when a row's table or
        lengths are out of range (nothing is read for it)."""
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[0]
        _require(q.stride(2) == 1 and q.stride(1) == dim and out.is_contiguous() and out.shape == q.shape
                 and out.dtype == q.dtype, "paged_attention: q [n, heads, dim] rows, out like q")
        _require(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                 and k_cache.dtype == q.dtype == v_cache.dtype and k_cache.shape[2] == dim
                 and k_cache.shape[1] % page_size == 0, "paged_attention: caches [kv_heads, slots, dim]")
        _require(pages.is_contiguous() and pages.dtype == torch.int64 and pages.dim() == 2, "paged_attention: pages")
        for t in (q_start, q_len, kv_len):
            _require(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (pages.shape[0],),
                     "paged_attention: [rows] int64 lengths")
        num_pages = k_cache.shape[1] // page_size
        rc = self.lib.kvfence_paged_attention(
            self._code(q), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
            num_pages, pages.data_ptr(), pages.shape[1], q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(),
            pages.shape[0], n, out.data_ptr(), out.stride(0), heads, kv_heads, dim, page_size, scale,
            torch.get_num_threads())
        if rc != 0:
            raise IndexError(_attention_refused(rc))


def _rope_store_refused(rc: int, where: str = "") -> str:
    return (f"rope_store{where}: token {-rc - 1} has a slot outside the pool or a position past the RoPE table; "
            f"nothing was written")


def _attention_refused(rc: int, where: str = "") -> str:
    return f"paged attention{where}: row {-rc - 1} has a page table or lengths outside the pool"


# -- the whole bf16 decoder stack in one call (stack.cpp) --------------------------------------
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _StackLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("qkv", _ptr), ("o", _ptr), ("ffn_norm", _ptr), ("gate_up", _ptr), ("down", _ptr),
                ("native", _i64), ("qkv_bytes", _i64), ("o_bytes", _i64), ("gate_up_bytes", _i64),
                ("down_bytes", _i64)]


class _StackShape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("num_layers", _i64), ("eps", _f32), ("scale", _f32), ("page_size", _i64)]


class _StackBatch(ctypes.Structure):
    _fields_ = [("n", _i64), ("positions", _ptr), ("write_slots", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("num_positions", _i64), ("kv", _ptr), ("num_slots", _i64), ("pages", _ptr), ("max_pages", _i64),
                ("q_start", _ptr), ("q_len", _ptr), ("kv_len", _ptr), ("rows", _i64), ("logits_rows", _ptr),
                ("num_logits", _i64)]


class _StackWork(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("x", "qkv", "attn", "proj", "act", "h_last", "attn_last")]


class DecoderStack:
    """The decoder layers of a bf16 model whose matmuls are all kvfence's, run as one kernel
    call: the same kernels in the same order as the model's per-kernel loop, without ~240
    trips through Python a step."""

    def __init__(self, kernels: CpuKernels, layers: list[tuple[torch.Tensor, ...]], final_norm: torch.Tensor,
                 heads: int, kv_heads: int, head_dim: int, inter: int, eps: float, native: bool = False):
        """layers: per layer (attn_norm, packed qkv, packed o, ffn_norm, gated gate_up, packed
        down), the matmul weights as CpuKernels.pack_weight made them, or with native as
        CpuKernels.qpack made them (their sizes are checked in C against their headers)."""
        self.kernels = kernels
        self._weights, self._final_norm = layers, final_norm  # what the pointers below point into
        for t in (*(x for layer in layers for x in layer), final_norm):
            _require(t.device.type == "cpu" and t.is_contiguous(), "decoder_stack: contiguous CPU weights")
        self.hidden = hidden = final_norm.shape[0]
        self.heads, self.kv_heads, self.head_dim, self.inter, self.eps = heads, kv_heads, head_dim, inter, eps
        q_size = heads * head_dim
        sizes = (kernels._packed_size(q_size + 2 * kv_heads * head_dim, hidden, False),
                 kernels._packed_size(hidden, q_size, False), kernels._packed_size(inter, hidden, True),
                 kernels._packed_size(hidden, inter, False))
        for attn_norm, qkv, o, ffn_norm, gate_up, down in layers:  # the C++ side trusts these sizes
            _require(attn_norm.shape == ffn_norm.shape == (hidden,)
                     and attn_norm.dtype == ffn_norm.dtype == torch.bfloat16
                     and (native or (qkv.numel(), o.numel(), gate_up.numel(), down.numel()) == sizes)
                     and all((t.dtype == torch.uint8) == native for t in (qkv, o, gate_up, down)),
                     "decoder_stack: bf16 norms and packed weights of the model's shapes")
        self._layers = (_StackLayer * len(layers))(*(
            _StackLayer(*(t.data_ptr() for t in layer), int(native),
                        *(t.numel() * t.element_size() for t in (layer[1], layer[2], layer[4], layer[5])))
            for layer in layers))

    def run(self, h: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, kv: torch.Tensor, pages: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
            kv_len: torch.Tensor, logits_rows: torch.Tensor, page_size: int) -> torch.Tensor:
        """h [n, hidden] float32 embeddings (updated in place as the residual stream); kv the pool
        [layers, 2, kv_heads, slots, head_dim]. Returns the final-normed hidden states of the
        logits rows [len(logits_rows), hidden]. Raises as the kernels it runs do."""
        n, hidden = h.shape
        bf16 = torch.bfloat16
        _require(h.dtype == torch.float32 and h.is_contiguous() and hidden == self.hidden,
                 "decoder_stack: h [n, hidden] float32")
        _require(kv.dtype == bf16 and kv.is_contiguous() and kv.dim() == 5 and kv.shape[0] == len(self._layers)
                 and kv.shape[1:3] == (2, self.kv_heads) and kv.shape[4] == self.head_dim
                 and kv.shape[3] % page_size == 0 and 0 < page_size <= MAX_PAGE_SIZE, "decoder_stack: kv pool")
        _require(cos.dtype == sin.dtype == bf16 and cos.is_contiguous() and sin.is_contiguous()
                 and cos.shape == sin.shape and cos.shape[1] == self.head_dim, "decoder_stack: cos/sin")
        _require(pages.dtype == torch.int64 and pages.is_contiguous() and pages.dim() == 2, "decoder_stack: pages")
        for t, size in ((positions, n), (write_slots, n), (q_start, pages.shape[0]), (q_len, pages.shape[0]),
                        (kv_len, pages.shape[0]), (logits_rows, logits_rows.shape[0])):
            _require(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (size,),
                     "decoder_stack: int64 indices")
        m, q_size = logits_rows.shape[0], self.heads * self.head_dim
        out = torch.empty(m, hidden, dtype=bf16)
        if n == 0:
            return out
        work = [torch.empty(rows, cols, dtype=dtype) for rows, cols, dtype in (
            (n, hidden, bf16), (n, q_size + 2 * self.kv_heads * self.head_dim, bf16), (n, q_size, bf16),
            (n, hidden, bf16), (n, self.inter, bf16), (m, hidden, torch.float32), (m, q_size, bf16))]
        shape = _StackShape(hidden, self.heads, self.kv_heads, self.head_dim, self.inter, len(self._layers),
                            self.eps, self.head_dim ** -0.5, page_size)
        batch = _StackBatch(n, positions.data_ptr(), write_slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            cos.shape[0], kv.data_ptr(), kv.shape[3], pages.data_ptr(), pages.shape[1],
                            q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), pages.shape[0],
                            logits_rows.data_ptr(), m)
        scratch = _StackWork(*(t.data_ptr() for t in work))
        err = (ctypes.c_int64 * 3)()
        rc = self.kernels.lib.kvfence_decoder_stack(
            ctypes.addressof(self._layers), ctypes.addressof(shape), ctypes.addressof(batch), ctypes.addressof(scratch),
            h.data_ptr(), self._final_norm.data_ptr(), out.data_ptr(), ctypes.addressof(err), torch.get_num_threads())
        if rc != 0:
            kind, layer, code = err
            if kind in (1, 2):
                refused = _rope_store_refused if kind == 1 else _attention_refused
                raise IndexError(refused(code, f" (layer {layer})"))
            if kind == 3:
                raise IndexError(f"decoder_stack: logits row {logits_rows[code].item()} is outside the batch of {n}")
            if kind == 5:
                which = ("qkv", "o", "gate_up", "down")[code]
                raise ValueError(f"decoder_stack: layer {layer}'s native {which} matmul refused its weight's shape")
            raise RuntimeError("this build of the CPU kernels has no bf16 (or native) matmul")
        return out
