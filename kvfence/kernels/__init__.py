"""Fused CPU kernels for the model's hot path, with tensor-level wrappers.

`cpu_kernels()` returns the kernels, or None when they are switched off
(KVFENCE_KERNELS=0) or cannot be built here; the model then uses plain torch ops, which
compute the same thing more slowly (tests/unit/test_kernels.py holds both to each other).
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("kvfence.kernels")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_UNSET = object()
_cached = _UNSET


def enabled_by_env() -> bool:
    return os.environ.get("KVFENCE_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


def cpu_kernels() -> "CpuKernels | None":
    """The process's kernels (built or loaded on first call), or None."""
    global _cached
    if _cached is _UNSET:
        _cached = None
        if enabled_by_env():
            try:
                from kvfence.kernels.build import load_library
                _cached = CpuKernels(load_library())
            except Exception as e:  # no compiler, failed build: slower, still correct
                log.warning("CPU kernels unavailable, using plain torch ops (slower): %s", e)
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
            raise IndexError(f"rope_store: token {-rc - 1} has a slot outside the pool or a position past the "
                             f"RoPE table; nothing was written")

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

    # -- bf16 matmul (gemm.cpp) ------------------------------------------------------------
    @property
    def has_gemm(self) -> bool:
        """Whether this build has the AVX512-BF16 matmul."""
        return bool(self.lib.kvfence_gemm_supported())

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

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, swiglu: bool = False) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times the packed [N, K] weight, transposed: [M, N].
        swiglu: packed holds gated panels; returns silu(x . gate^T) * (x . up^T), [M, N]."""
        m, k = x.shape
        _require(x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1 and x.stride(0) >= k,
                 "linear: x bf16 CPU, rows contiguous")
        _require(k % 2 == 0 and packed.numel() == self._packed_size(n, k, swiglu), "linear: packed weight of [n, k]")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m:
            gemm = self.lib.kvfence_gemm_swiglu if swiglu else self.lib.kvfence_gemm
            rc = gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n, m, n, k, torch.get_num_threads())
            if rc != 0:
                raise RuntimeError("this build of the CPU kernels has no bf16 matmul")
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
            raise IndexError(f"paged attention: row {-rc - 1} has a page table or lengths outside the pool")
