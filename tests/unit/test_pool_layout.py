"""Position addressing inside pool pages (K dim-major, V slot-major) agrees everywhere:
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
