"""The KV page pool: one tensor holding every layer's keys and values, sized from a memory budget."""
from __future__ import annotations

import math
import os
import re

import torch

from kvfence.kv.ledger import NULL_PAGE, ScrubPolicy
from kvfence.model.config import ModelConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


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


class KVPool:
    """Page p holds slots p*page_size .. (p+1)*page_size - 1 of every layer's K and V.

    Layout [layers, 2, kv_heads, slots, head_dim]: one page of one head is a contiguous
    block of page_size * head_dim elements, so a sequence's pages gather with one flat copy
    each and a transfer moves whole pages. Inside a page, V is slot-major [page_size,
    head_dim] and K is dim-major [head_dim, page_size]: the attention kernel scores a query
    against a page's keys as head_dim multiply-adds over page_size contiguous lanes
    (kernels/cpu_kernels.cpp). Whole-page operations (scrub, copy, transfer) do not care;
    anything that addresses single positions inside a page goes through this class."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str):
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
                    device: str) -> "KVPool":
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
        L, two, H, total, D = kv.shape
        if start >= total:
            return
        ps = self.page_size
        kv[:, 1, :, start:, :] = 0                                   # V: slot-major
        k = kv[:, 0].view(L, H, total // ps, D, ps)                  # K: dim-major per page
        first, offset = divmod(start, ps)
        k[:, :, first, :, offset:] = 0
        k[:, :, first + 1:] = 0
