"""The transfer buffer: where sealed KV pages wait, page-contiguous, for a pull.

The KV pool keeps each page spread over layers and heads (fast attention), which would
make a transfer thousands of 2 KiB pieces (measured: 71 MiB/s over Mooncake TCP, against
1.7 GiB/s for whole ~360 KiB pages). So pages cross the wire through this buffer: one
registered CPU tensor of rows, each row one page as AES-GCM ciphertext of [layers, K/V,
heads, slots, head_dim] followed by its tag (kvfence/pd/seal.py). Prefill seals a
request's pages in and holds the rows under a lease; decode pulls rows into its own
buffer, copies each out into private memory, authenticates and decrypts that copy, and
copies only the plaintext it authenticated into its pool pages. A transfer never writes a
pool page, and what a network peer can read or write here is ciphertext or zeros.

Rows are granted, fenced and freed by a Ledger of their own (the same ownership rules as
pool pages: one owner, epochs, quarantine until a fence proves no transfer can touch
them), and zeroed when freed: a free row holds nothing.
"""
from __future__ import annotations

import torch

from kvfence.kv.ledger import BlockTable, Ledger, Owner, ScrubPolicy
from kvfence.kv.pool import KVPool
from kvfence.pd.manifest import page_header
from kvfence.pd.messages import Manifest
from kvfence.pd.seal import TAG_BYTES, RowCipher


def kv_layout(pool: KVPool) -> str:
    L, two, H, _, D = pool.kv.shape
    return (f"layers={L},kv={two},heads={H},page={pool.page_size},dim={D},k=dim-pairs,v=slot-pairs,"
            f"dtype={str(pool.dtype).removeprefix('torch.')},sealed=aes-256-gcm")


class StagingBuffer:
    def __init__(self, pool: KVPool, num_rows: int):
        self.pool = pool
        L, two, H, _, D = pool.kv.shape
        self.page_shape = (L, two, H, pool.page_size, D)
        self.data_bytes = pool.bytes_per_page
        self.slot_bytes = self.data_bytes + TAG_BYTES
        # row 0 is the ledger's null page: never granted
        self.ledger = Ledger(num_rows + 1, page_size=1, scrub=ScrubPolicy.ZERO, scrubber=self._zero)
        self.buf = torch.zeros(num_rows + 1, self.slot_bytes, dtype=torch.uint8)
        self.layout = kv_layout(pool)

    def _zero(self, rows: list[int], _policy: ScrubPolicy) -> None:
        self.buf[rows] = 0

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
    def stage(self, pages: list[int], rows: BlockTable, m: Manifest, cipher: RowCipher, seal: bool = True) -> None:
        """Seal pool pages into rows, each bound to its page header; slots past the token
        count are zeroed first so nothing but this request's own KV leaves the node.
        seal=False is the skip_row_seal fault point, for tests only."""
        if not pages:
            return
        plain = self.plaintext_rows(pages, m.token_count).numpy()
        buf = self.buf.numpy()
        for i, r in enumerate(rows.pages):
            if seal:
                cipher.seal_into(i, plain[i].data, page_header(m, i).pack(), buf[r].data)
            else:
                buf[r, :self.data_bytes] = plain[i]

    def plaintext_rows(self, pages: list[int], token_count: int) -> torch.Tensor:
        """The pages as rows of bytes [n, data_bytes], page-contiguous, slots from
        token_count on zeroed: what stage() seals (private memory)."""
        n, ps = len(pages), self.pool.page_size
        slots = self.pool.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.pool.device))
        kv = self.pool.kv.index_select(3, slots)                              # [L, 2, H, n*ps, D]
        L, two, H, _, D = self.page_shape
        self.pool.clear_positions_from(kv, token_count)
        plain = kv.view(L, two, H, n, ps, D).permute(3, 0, 1, 2, 4, 5).contiguous().cpu().view(n, -1)
        return plain.view(torch.uint8)

    # -- decode side --------------------------------------------------------------------
    def open_rows(self, rows: list[int], m: Manifest, cipher: RowCipher, authenticate: bool = True) -> torch.Tensor:
        """Each row copied out of the registered buffer into private memory, authenticated
        and decrypted there (SealError on the first that fails): [n, data_bytes] uint8.
        authenticate=False is the skip_row_auth fault point, for tests only."""
        out = torch.empty(len(rows), self.data_bytes, dtype=torch.uint8)
        buf, dst = self.buf.numpy(), out.numpy()
        for i, r in enumerate(rows):
            sealed = buf[r].tobytes()   # the private copy: what is checked is what is used
            if authenticate:
                cipher.open_into(i, sealed, page_header(m, i).pack(), dst[i].data)
            else:
                cipher.open_unauthenticated_into(i, sealed, dst[i].data)
        return out

    def unstage(self, plain: torch.Tensor, pages: list[int]) -> None:
        """Copy authenticated plaintext pages into pool pages (the only way transferred KV
        reaches the pool)."""
        n = len(pages)
        if n == 0:
            return
        L, two, H, ps, D = self.page_shape
        data = plain.contiguous().view(self.pool.dtype).view(n, L, two, H, ps, D)
        kv = data.permute(1, 2, 3, 0, 4, 5).reshape(L, two, H, n * ps, D).to(self.pool.device)
        slots = self.pool.slots_of(torch.as_tensor(pages, dtype=torch.int64, device=self.pool.device))
        self.pool.kv.index_copy_(3, slots, kv)

    def row_addresses(self, rows: list[int]) -> list[int]:
        return [self.base + r * self.slot_bytes for r in rows]
