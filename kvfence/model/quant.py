"""A GGUF weight kept in its quantized blocks (`--weights native`), for kernels/qgemm.cpp.

The loader hands these to the model instead of dequantized tensors for the types the native
matmul takes (Q4_0, Q4_1, Q8_0); `Linear` and `SwiGLU` pack them for the kernel, and
dequantize them as today where it cannot run them (a CPU without AVX2, another type)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ggml type ids the native matmul takes, and their blocks: 32 weights in so many bytes
NATIVE_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
BLOCK = 32


@dataclass
class QuantWeight:
    """[rows, cols] weights as GGUF blocks: `blocks` is uint8 [rows, cols / 32 * block bytes]."""
    ggml_type: int
    rows: int
    cols: int
    blocks: np.ndarray

    def __post_init__(self):
        name, size = NATIVE_TYPES[self.ggml_type]
        if self.cols % BLOCK or self.blocks.dtype != np.uint8 or self.blocks.shape != (self.rows,
                                                                                         self.cols // BLOCK * size):
            raise ValueError(f"{name} weight [{self.rows}, {self.cols}]: blocks of shape {self.blocks.shape}")
        self.blocks = np.ascontiguousarray(self.blocks)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.ggml_type][0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import gguf

        arr = gguf.quants.dequantize(self.blocks, gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype)


Weight = torch.Tensor | QuantWeight


def cat_rows(weights: list[Weight], dtype: torch.dtype) -> Weight:
    """The weights stacked by rows: still blocks when all are blocks of one type, else tensors."""
    if all(isinstance(w, QuantWeight) for w in weights):
        qs = [w for w in weights if isinstance(w, QuantWeight)]
        if len({(w.ggml_type, w.cols) for w in qs}) == 1:
            return QuantWeight(qs[0].ggml_type, sum(w.rows for w in qs), qs[0].cols,
                               np.concatenate([w.blocks for w in qs], 0))
    return torch.cat([dense(w, dtype) for w in weights], 0)


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w
