"""Position addressing inside pool pages (K and V in pairs, kv/pool.py) agrees everywhere:
the model's store and gather, and the staging buffer's tail clearing."""
from __future__ import annotations

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.llama import LlamaModel
from kvfence.sim.model import tiny_config


def test_clear_positions_from_zeroes_exactly_the_positions_past_the_prompt():
    cfg = tiny_config(layers=2, hidden=32, heads=4, kv_heads=2)
    ps, pages = 8, [3, 1]
    pool = KVPool(cfg, num_pages=5, page_size=ps, dtype=torch.float32, device="cpu")
    positions = torch.arange(len(pages) * ps)
    slots = torch.tensor(pages)[positions // ps] * ps + positions % ps
    for layer in range(cfg.num_layers):  # K and V of position p hold p + 1 (and -(p + 1))
        val = (positions + 1).float().view(-1, 1, 1).expand(-1, cfg.num_kv_heads, cfg.head_dim)
        LlamaModel._store(pool.kv[layer, 0], pool.kv[layer, 1], val, -val, slots, ps)
    copy = pool.read_pages(pages)
    pool.clear_positions_from(copy, 11)
    for layer in range(cfg.num_layers):
        # read the copy back by position through the model's own gather
        k, v = LlamaModel._gather(copy[layer, 0], copy[layer, 1], torch.tensor([[0, 1]]), ps)
        want = torch.where(positions < 11, positions + 1, 0).float().view(1, 1, -1, 1)
        assert torch.equal(k, want.expand_as(k)) and torch.equal(v, -want.expand_as(v))
    # the pool itself is untouched
    k, _ = LlamaModel._gather(pool.kv[0, 0], pool.kv[0, 1], torch.tensor([pages]), ps)
    assert torch.equal(k[0, 0, :, 0], (positions + 1).float())


def test_staging_sends_no_position_past_the_prompt():
    """Prefill seals a request's pages into transfer rows; the slots past its token count
    (an earlier owner's bytes, in the pool's in-page layout) must leave the node as zeros:
    what the rows open to is read back by position."""
    from kvfence.kv.ledger import Owner
    from kvfence.pd.messages import Manifest
    from kvfence.pd.seal import RowCipher, new_salt
    from kvfence.pd.staging import StagingBuffer

    cfg = tiny_config(layers=2, hidden=32, heads=4, kv_heads=2)
    ps, pages, tokens = 8, [2, 4], 11
    pool = KVPool(cfg, num_pages=5, page_size=ps, dtype=torch.float32, device="cpu")
    pool.kv.fill_(7.0)  # every slot holds something: stale bytes past the prompt included
    staging = StagingBuffer(pool, num_rows=4)
    rows = staging.grant(Owner(tenant=1, request=1), len(pages))
    m = Manifest(request_id="r1", tenant="t1", token_count=tokens, page_count=len(pages), page_size=ps,
                 epochs=list(rows.epochs), fingerprint="f", layout=staging.layout, boot_id="boot",
                 seal_salt=new_salt(), seal_key="0" * 16, slot_bytes=staging.slot_bytes, slots=list(rows.pages),
                 lease_deadline=1.0)
    cipher = RowCipher(b"s" * 32, m.seal_salt, "boot", "r1", "t1")
    staging.stage(pages, rows, m, cipher)
    L, two, H, _, D = pool.kv.shape
    data = staging.open_rows(rows.pages, m, cipher).view(torch.float32)
    kv = data.view(len(pages), L, two, H, ps, D).permute(1, 2, 3, 0, 4, 5).reshape(L, two, H, len(pages) * ps, D)
    positions = torch.arange(len(pages) * ps)
    for layer in range(L):  # read back by position through the model's gather
        k, v = LlamaModel._gather(kv[layer, 0], kv[layer, 1], torch.tensor([[0, 1]]), ps)
        want = torch.where(positions < tokens, 7.0, 0.0).view(1, 1, -1, 1)
        assert torch.equal(k, want.expand_as(k)) and torch.equal(v, want.expand_as(v))


def test_k_element_is_where_k_pages_puts_a_key():
    """The flat offset rule (kv/pool.py k_element, cpu_kernels.cpp k_at) and the view agree."""
    from kvfence.kv.pool import k_element, k_pages

    ps, dim = 4, 6
    plane = torch.arange(2 * ps * dim).view(1, 2 * ps, dim)
    pages = k_pages(plane, ps)
    for d in range(dim):
        for j in range(ps):
            assert pages[0, 1, d // 2, j, d % 2] == ps * dim + k_element(d, j, ps)


def test_an_odd_page_size_is_refused_with_the_reason():
    import pytest

    with pytest.raises(ValueError, match="even"):
        KVPool(tiny_config(), num_pages=4, page_size=5, dtype=torch.float32, device="cpu")


def test_store_then_gather_returns_each_position_for_one_page_or_many():
    """The torch path's store and gather agree, in both dtypes (a pair moves as one int32 or
    int64 element in the gather), and with a single page per row (a view, not a copy)."""
    for dtype in (torch.float32, torch.bfloat16):
        cfg = tiny_config(layers=1, hidden=32, heads=4, kv_heads=2)
        ps = 4
        pool = KVPool(cfg, num_pages=6, page_size=ps, dtype=dtype, device="cpu")
        for pages in ([[3]], [[2, 5], [1, 4]]):
            table = torch.tensor(pages)
            slots = (table.unsqueeze(-1) * ps + torch.arange(ps)).flatten()
            vals = torch.randn(len(slots), cfg.num_kv_heads, cfg.head_dim).to(dtype)
            LlamaModel._store(pool.kv[0, 0], pool.kv[0, 1], vals, -vals, slots, ps)
            k, v = LlamaModel._gather(pool.kv[0, 0], pool.kv[0, 1], table, ps)
            want = vals.view(table.shape[0], -1, cfg.num_kv_heads, cfg.head_dim).permute(2, 0, 1, 3)
            assert torch.equal(k, want) and torch.equal(v, -want), (dtype, pages)
