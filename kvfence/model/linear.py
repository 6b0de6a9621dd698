"""y = x @ W.T, with W reordered once into the fastest layout this machine has.

bf16 on a CPU with AVX512-BF16: kvfence's own matmul (kernels/gemm.cpp), ~1.3x oneDNN at
decode's 32 rows and ~1.1x at prefill's 2048 on a 2-core Zen 4 for this model's shapes.
Else bf16 on CPU: oneDNN's packed weights, 1.2-1.6x F.linear at 32 rows, ~1.1x at 2048.
float32 keeps F.linear: a packed kernel sums in another order than MKL (~1e-4 apart), which
would cost float32 its role as the mode that matches the reference. CUDA: F.linear.
Every packed form is checked against F.linear on a probe before it is used.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfence.kernels import cpu_kernels

log = logging.getLogger("kvfence.model")


def _onednn_ok(weight: torch.Tensor) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    def __init__(self, weight: torch.Tensor, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.backend = "torch"
        self.weight = weight.contiguous()
        if not pack or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return
        kernels = cpu_kernels()
        if kernels is not None and kernels.has_gemm and self.in_features % 2 == 0:
            self._try("kvfence", kernels.pack_weight(self.weight))
        if self.backend == "torch" and _onednn_ok(weight):
            try:
                self._try("onednn", torch.ops.mkldnn._reorder_linear_weight(self.weight, None))
            except RuntimeError as e:  # an older oneDNN, an odd shape: plain F.linear is fine
                log.debug("oneDNN weight packing unavailable: %s", e)

    def _try(self, backend: str, packed: torch.Tensor) -> None:
        """Use packed through backend if it agrees with F.linear on a probe."""
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(self.weight.dtype)
        plain = self.weight
        self.backend, self.weight = backend, packed
        if torch.allclose(self(probe).float(), F.linear(probe, plain).float(), rtol=2e-2, atol=2e-2):
            return
        log.warning("%s packed matmul disagrees with F.linear on a probe; not using it", backend)
        self.backend, self.weight = "torch", plain

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "kvfence":
            return cpu_kernels().linear(x, self.weight, self.out_features)
        if self.backend == "onednn":  # the resolved overload: skips the op packet's per-call lookup
            return torch.ops.mkldnn._linear_pointwise.default(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)
