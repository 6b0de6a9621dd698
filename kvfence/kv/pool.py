"""The KV page pool: one tensor holding every layer's keys and values, sized from a memory budget."""
from __future__ import annotations

import math
import os
import re

import torch

from kvfence.kv.ledger import NULL_PAGE, ScrubPolicy
from kvfence.model.config import ModelConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2G', '1.5gb' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem


def k_pages(plane: torch.Tensor, page_size: int) -> torch.Tensor:
    """One layer's K plane [kv_heads, slots, head_dim] as [kv_heads, pages, head_dim/2,
    page_size, 2]: the key of position j, dims d and d+1 (d even), at [:, page, d/2, j, :]."""
    h, slots, d = plane.shape
    return plane.view(h, slots // page_size, d // 2, page_size, 2)


def k_element(d: int, j: int, page_size: int) -> int:
    """Where dim d of position j's key lies inside one head's K page, in elements."""
    return ((d // 2) * page_size + j) * 2 + d % 2


def v_pages(plane: torch.Tensor, page_size: int) -> torch.Tensor:
    """One layer's V plane as [kv_heads, pages, page_size/2, head_dim, 2]: the value of
    position j at [:, page, j/2, :, j%2]."""
    h, slots, d = plane.shape
    return plane.view(h, slots // page_size, page_size // 2, d, 2)


class KVPool:
    """Page p holds slots p*page_size .. (p+1)*page_size - 1 of every layer's K and V.

    Layout [layers, 2, kv_heads, slots, head_dim]: one page of one head is a contiguous
    block of page_size * head_dim elements, so a sequence's pages gather with one flat copy
    each and a transfer moves whole pages. Inside a page, elements sit in pairs along the
    attention kernel's reductions (kernels/cpu_kernels.cpp multiplies 16 bf16 pairs per
    instruction, vdpbf16ps): K pairs dims (d, d+1) of each position, [head_dim/2, page_size, 2],
    so scoring a query against a page is head_dim/2 pair products over page_size lanes; V
    pairs positions (j, j+1), [page_size/2, head_dim, 2], for probabilities times values. The
    kernel reads a page as it lies, with no repacking (a decode step's attention for 32 x 320
    tokens: 13.8 ms with pages repacked per read, 10.0 ms as they lie). Page sizes are
    therefore even. `k_pages`, `v_pages` and `k_element` are the one description of this
    layout in Python; whole-page operations (scrub, copy, transfer) do not depend on it."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str):
        if page_size < 2 or page_size % 2 or cfg.head_dim % 2:
            raise ValueError(f"page size {page_size} with head dim {cfg.head_dim}: both must be even (the KV "
                             f"pool stores positions and dimensions in pairs), e.g. --page-size 16")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = device
        self.bytes_per_page = page_bytes(cfg, page_size, dtype)
        # zeros, so the null page reads as zeros and an unscrubbed fresh pool holds no stale data
        self.kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, num_pages * page_size, cfg.head_dim,
                              dtype=dtype, device=device)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype,
                    device: str) -> KVPool:
        per = page_bytes(cfg, page_size, dtype)
        num_pages = budget_bytes // per
        if num_pages < 2:
            raise ValueError(f"KV memory budget {budget_bytes} bytes holds fewer than 2 pages "
                             f"of {per} bytes; give --kv-cache-memory more room")
        return cls(cfg, int(num_pages), page_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """All slot indices of the given pages, in order."""
        return (pages.unsqueeze(-1) * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten()

    def scrub(self, pages: list[int], policy: ScrubPolicy) -> None:
        """Overwrite freed pages: zeros, or a poison value that makes any stray read loud."""
        if NULL_PAGE in pages:
            raise ValueError("the null page is never scrubbed or handed out")
        slots = self.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.device))
        value = 0.0 if policy is ScrubPolicy.ZERO else (math.nan if self.dtype.is_floating_point else -1)
        self.kv.index_fill_(3, slots, value)

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of the given pages' contents, [layers, 2, kv_heads, len(pages)*page_size, head_dim]."""
        slots = self.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.device))
        return self.kv.index_select(3, slots)

    def clear_positions_from(self, kv: torch.Tensor, start: int) -> None:
        """Zero token positions start.. of a page copy kv [layers, 2, kv_heads, n*page_size,
        head_dim] (as read_pages returns), in this pool's in-page layout."""
        total, ps = kv.shape[3], self.page_size
        if start >= total:
            return
        first, offset = divmod(start, ps)
        for layer in kv:
            k, v = k_pages(layer[0], ps), v_pages(layer[1], ps)
            k[:, first, :, offset:] = 0
            k[:, first + 1:] = 0
            if offset % 2:  # the pair that holds the last kept position keeps that half
                v[:, first, offset // 2, :, 1] = 0
            v[:, first, -(-offset // 2):] = 0
            v[:, first + 1:] = 0
