"""The transfer buffer: where KV pages wait, page-contiguous, for a pull.

The KV pool keeps each page spread over layers and heads (fast attention), which would
make a transfer thousands of 2 KiB pieces (measured: 71 MiB/s over Mooncake TCP, against
1.7 GiB/s for whole ~360 KiB pages). So pages cross the wire through this buffer: one
registered CPU tensor of rows, each row one page as [header | layers, K/V, heads,
slots, head_dim]. Prefill copies a request's pages in and holds the rows under a lease;
decode pulls rows into its own buffer, verifies them, and only then copies them into its
pool pages. A transfer therefore never writes a pool page.

Rows are granted, fenced and freed by a Ledger of their own (the same ownership rules as
pool pages: one owner, epochs, quarantine until a fence proves no transfer can touch them).
"""
from __future__ import annotations

import torch

from kvfence.kv.ledger import BlockTable, Ledger, Owner, ScrubPolicy
from kvfence.kv.pool import KVPool
from kvfence.pd.manifest import HEADER_BYTES, PageHeader, page_checksum


def kv_layout(pool: KVPool) -> str:
    L, two, H, _, D = pool.kv.shape
    return (f"layers={L},kv={two},heads={H},page={pool.page_size},dim={D},k=dim-pairs,v=slot-pairs,"
            f"dtype={str(pool.dtype).removeprefix('torch.')}")


class StagingBuffer:
    def __init__(self, pool: KVPool, num_rows: int):
        self.pool = pool
        L, two, H, _, D = pool.kv.shape
        self.page_shape = (L, two, H, pool.page_size, D)
        self.data_bytes = pool.bytes_per_page
        self.slot_bytes = HEADER_BYTES + self.data_bytes
        # row 0 is the ledger's null page: never granted
        self.ledger = Ledger(num_rows + 1, page_size=1, scrub=ScrubPolicy.NONE)
        self.buf = torch.zeros(num_rows + 1, self.slot_bytes, dtype=torch.uint8)
        self.layout = kv_layout(pool)

    @property
    def capacity_pages(self) -> int:
        return self.ledger.usable_pages

    @property
    def base(self) -> int:
        return self.buf.data_ptr()

    def grant(self, owner: Owner, n: int) -> BlockTable:
        rows = BlockTable()
        self.ledger.allocate(owner, n, rows)
        return rows

    # -- prefill side -------------------------------------------------------------------
    def stage(self, pages: list[int], rows: BlockTable, token_count: int, request_id: str, tenant: str,
              boot_id: str) -> list[str]:
        """Copy pool pages into rows with their headers; slots past token_count are zeroed so
        nothing but this request's own KV leaves the node. Returns per-page checksums."""
        n = len(pages)
        if n == 0:
            return []
        ps = self.pool.page_size
        slots = self.pool.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.pool.device))
        kv = self.pool.kv.index_select(3, slots)                              # [L, 2, H, n*ps, D]
        L, two, H, _, D = self.page_shape
        self.pool.clear_positions_from(kv, token_count)
        paged = kv.view(L, two, H, n, ps, D).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        idx = rows.pages
        self.buf[idx, HEADER_BYTES:] = paged.view(n, -1).view(torch.uint8)
        sums = []
        for i, r in enumerate(idx):
            tokens = min(ps, token_count - i * ps)
            h = PageHeader(request_id, tenant, boot_id, rows.epochs[i], i, n, tokens)
            self.buf[r, :HEADER_BYTES] = torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8)
            sums.append(page_checksum(self.row_bytes(r)))
        return sums

    def row_bytes(self, row: int) -> memoryview:
        return memoryview(self.buf[row].numpy())

    # -- decode side --------------------------------------------------------------------
    def rows_bytes(self, rows: list[int]) -> list[memoryview]:
        return [self.row_bytes(r) for r in rows]

    def unstage(self, rows: list[int], pages: list[int]) -> None:
        """Copy verified rows into pool pages (the only way transferred KV reaches the pool)."""
        n = len(rows)
        if n == 0:
            return
        L, two, H, ps, D = self.page_shape
        data = self.buf[rows, HEADER_BYTES:].contiguous().view(self.pool.dtype).view(n, L, two, H, ps, D)
        kv = data.permute(1, 2, 3, 0, 4, 5).reshape(L, two, H, n * ps, D).to(self.pool.device)
        slots = self.pool.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.pool.device))
        self.pool.kv.index_copy_(3, slots, kv)

    def row_addresses(self, rows: list[int]) -> list[int]:
        return [self.base + r * self.slot_bytes for r in rows]
