"""y = x @ W.T, with W reordered once into the fastest layout this machine has.

bf16 on a CPU with AVX512-BF16: kvfence's own matmul (kernels/gemm.cpp), ~1.3x oneDNN at
decode's 32 rows and ~1.1x at prefill's 2048 on a 2-core Zen 4 for this model's shapes. On a
CPU with AVX2 + FMA but no AVX512-BF16 (Zen 3), the same matmul with the weights widened in
registers: 85-106 GFLOP/s at 32-512 rows on 2 Zen 3 cores, where torch's bf16 F.linear does
~15 (no oneDNN bf16 there) and float32 F.linear 57-126 with twice the weight bytes.
Else bf16 on CPU: oneDNN's packed weights, 1.2-1.6x F.linear at 32 rows, ~1.1x at 2048.
float32 keeps F.linear: a packed kernel sums in another order than MKL (~1e-4 apart), which
would cost float32 its role as the mode that matches the reference. CUDA: F.linear.
Every packed form is checked against F.linear on a probe before it is used.

Native GGUF weights (`--weights native`, a QuantWeight): kvfence's integer matmul (AVX512-VNNI or AVX2) over the GGUF's
own blocks (kernels/qgemm.cpp), activations quantized to int8 per row and 32-block; checked on
a probe against F.linear with the dequantized weight (within the activations' quantization
error). Where the kernel cannot run them (no AVX2, another type) they are dequantized to the
model's dtype and take the paths above, as every GGUF did before.

float_out (the LM head): float32 output from bf16 (or fp16) weights, the sums never rounded to
the weights' dtype (logits rounded to bf16 tied near-ties and quantized logprobs, issue #16).
kvfence's matmul stores its float32 sums as they are; CUDA asks cuBLAS for float32 output
(torch.mm out_dtype); elsewhere (no kvfence matmul) a float32 copy of the weight and F.linear.

SwiGLU: the MLP's gate and up projections and the activation between them. With kvfence's
matmul they are one pass whose epilogue applies silu(gate) * up (prefill: ~6% less time than
the matmul and a separate activation pass); else a gate|up Linear and the activation after it.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfence.kernels import cpu_kernels
from kvfence.model.quant import QuantWeight, Weight, dense

log = logging.getLogger("kvfence.model")


MATMULS = ("auto", "kvfence", "onednn")


def resolve_matmul(choice: str) -> str:
    """Whose bf16 matmul the decoder layers run on CPU. auto: oneDNN's on a CPU with AMX tiles
    (oneDNN runs bf16 on them, kvfence's kernel has none: 4-11x kvfence's per matmul and the
    fixed workload in ~0.57x the time on a 2-core Xeon, docs/performance.md), else kvfence's
    (1.3-4.4x oneDNN's on AVX512-BF16 without AMX, and the only fast one on AVX2). The LM head
    stays on kvfence's either way: its float32 logits (#16) are a kvfence kernel's output."""
    if choice not in MATMULS:
        raise ValueError(f"matmul must be one of {', '.join(MATMULS)}; got {choice!r}")
    if choice != "auto":
        return choice
    from kvfence.kernels.build import cpu_flags

    return "onednn" if "amx_bf16" in cpu_flags() and _onednn_bf16() else "kvfence"


def _onednn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    def __init__(self, weight: Weight, pack: bool = True, float_out: bool = False,
                 dtype: torch.dtype = torch.bfloat16, matmul: str = "kvfence"):
        """dtype: what a QuantWeight the native matmul cannot take is dequantized to; matmul:
        "kvfence" or "onednn" (resolve_matmul), whose packed bf16 matmul to try first."""
        self.out_features, self.in_features = weight.shape
        self.backend = "torch"
        self.float_out = float_out
        self.matmul = matmul
        self._wide = None  # float_out outside kvfence's matmul: x -> float32 x . W^T
        if isinstance(weight, QuantWeight):
            packed = _native_pack(weight, None, lambda p: _native_out(p, self.out_features, False, float_out))
            if packed is not None:
                self.backend, self.weight, self.format = "native", packed, weight.type_name
                return
            weight = weight.dequantize(dtype)
        self.weight = weight.contiguous()
        if pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            self._pack(weight)
        if float_out and self.backend == "torch" and weight.dtype != torch.float32:
            self._wide = _wide_matmul(self.weight)

    def _pack(self, weight: torch.Tensor) -> None:
        kernels = cpu_kernels()
        # float32 logits come from kvfence's matmul whichever runs the layers
        if (kernels is not None and kernels.has_gemm and self.in_features % 2 == 0
                and (self.matmul == "kvfence" or self.float_out)):
            self._try("kvfence", kernels.pack_weight(self.weight))
        # oneDNN's packed matmul writes bf16 only
        if self.backend == "torch" and not self.float_out and _onednn_bf16():
            try:
                self._try("onednn", torch.ops.mkldnn._reorder_linear_weight(self.weight, None))
            except RuntimeError as e:  # an older oneDNN, an odd shape: plain F.linear is fine
                log.debug("oneDNN weight packing unavailable: %s", e)

    def _try(self, backend: str, packed: torch.Tensor) -> None:
        """Use packed through backend if it agrees with F.linear on a probe."""
        plain = self.weight
        self.backend, self.weight = backend, packed
        if _agrees(self, lambda probe: F.linear(probe, plain), self.in_features):
            return
        log.warning("%s packed matmul disagrees with F.linear on a probe; not using it", backend)
        self.backend, self.weight = "torch", plain

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "native":
            return cpu_kernels().qlinear(x, self.weight, self.out_features,
                                         out_dtype=torch.float32 if self.float_out else torch.bfloat16)
        if self.backend == "kvfence":
            return cpu_kernels().linear(x, self.weight, self.out_features,
                                        out_dtype=torch.float32 if self.float_out else torch.bfloat16)
        if self.backend == "onednn":  # the resolved overload: skips the op packet's per-call lookup
            return torch.ops.mkldnn._linear_pointwise.default(x, self.weight, None, "none", [], "")
        if self._wide is not None:
            return self._wide(x)
        y = F.linear(x, self.weight)
        return y.float() if self.float_out else y


def _wide_matmul(weight: torch.Tensor):
    """x -> x . weight^T in float32 without rounding the sums to weight's dtype: cuBLAS's float32
    output where this torch has it (checked on a probe), else a float32 copy of the weight."""
    if weight.device.type == "cuda":
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        try:
            if torch.mm(probe, weight[:1].t(), out_dtype=torch.float32).dtype == torch.float32:
                return lambda x: torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as e:
            log.debug("torch.mm out_dtype unavailable: %s", e)
    wide = weight.float()
    return lambda x: F.linear(x.float(), wide)


def _agrees(fn, reference, in_features: int) -> bool:
    probe = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return torch.allclose(fn(probe).float(), reference(probe).float(), rtol=2e-2, atol=2e-2)


def _native_out(packed: torch.Tensor, n: int, swiglu: bool, float_out: bool = False):
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels().qlinear(x, packed, n, swiglu=swiglu,
                                     out_dtype=torch.float32 if float_out else torch.bfloat16)
    return fn


def _native_pack(weight: QuantWeight, up: QuantWeight | None, run) -> torch.Tensor | None:
    """weight (and up, for gated panels) packed for the native matmul, if this build has it and
    `run(packed)` (x -> y) agrees with the dequantized float32 weights on a probe; else None."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_qgemm or (up is not None and up.ggml_type != weight.ggml_type):
        return None
    packed = kernels.qpack(weight.ggml_type, weight.blocks, weight.rows, weight.cols,
                           None if up is None else up.blocks)
    probe = torch.randn(3, weight.cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = F.linear(probe.float(), weight.dequantize())
    if up is not None:
        ref = F.silu(ref) * F.linear(probe.float(), up.dequantize())
    # int8 activations put ~0.5% (relative, in norm) on the product; a layout bug puts ~100%
    err = (run(packed)(probe).float() - ref).norm() / ref.norm().clamp_min(1e-30)
    if err < 0.05:
        return packed
    log.warning("native %s matmul disagrees with the dequantized weights on a probe (%.3f); not using it",
                weight.type_name, err)
    return None


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu = [gate | up] on the last dimension: the CPU kernel where it
    takes gu, else torch ops (same roundings in bf16)."""
    kernels = cpu_kernels()
    if kernels is not None and gu.device.type == "cpu" and gu.dtype in (torch.float32, torch.bfloat16):
        return kernels.silu_mul(gu.contiguous())
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU:
    """silu(x @ gate.T) * (x @ up.T)."""

    def __init__(self, gate: Weight, up: Weight, dtype: torch.dtype = torch.bfloat16, matmul: str = "kvfence"):
        self.inter = gate.shape[0]
        self.gated = None  # the gated panels of kvfence's matmul, when it takes them
        self.native = None  # the gated panels of the native matmul over GGUF blocks
        if isinstance(gate, QuantWeight) and isinstance(up, QuantWeight):
            self.native = _native_pack(gate, up, lambda p: _native_out(p, self.inter, True))
            if self.native is not None:
                self.format, self.gate_up = gate.type_name, None
                return
        gate, up = dense(gate, dtype), dense(up, dtype)
        kernels = cpu_kernels()
        if (matmul == "kvfence" and kernels is not None and kernels.has_gemm and gate.device.type == "cpu"
                and gate.dtype == torch.bfloat16 and gate.shape[1] % 2 == 0):
            self.gated = kernels.pack_weight(gate, up)
            if not _agrees(self, lambda probe: silu_mul(F.linear(probe, torch.cat([gate, up], 0))), gate.shape[1]):
                log.warning("kvfence gated matmul disagrees with F.linear + SiLU on a probe; not using it")
                self.gated = None
        self.gate_up = None if self.gated is not None else Linear(torch.cat([gate, up], 0), matmul=matmul)

    @property
    def backend(self) -> str:
        if self.native is not None:
            return "native"
        return "kvfence" if self.gated is not None else self.gate_up.backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return cpu_kernels().qlinear(x, self.native, self.inter, swiglu=True)
        if self.gated is not None:
            return cpu_kernels().linear(x, self.gated, self.inter, swiglu=True)
        return silu_mul(self.gate_up(x))
