"""Llama-family decoder over a paged KV cache: token ids in, logits out.

The forward pass takes a flat batch of tokens from many sequences. Linear layers run on
the flat batch; attention runs per bucket of sequences with the same query length, reading
keys and values from the pool through slot indices that the runner built and the ledger
checked (I2, I3). The model never decides which slots a sequence may read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model.config import ModelConfig
from kvfence.model.weights import ModelWeights


@dataclass
class AttentionBucket:
    """Rows token_start .. token_start + num_rows*q_len of the flat batch: num_rows
    sequences with q_len new tokens each."""
    token_start: int
    num_rows: int
    q_len: int
    kv_pages: torch.Tensor | None   # [rows, P] pool pages to attend (padding -> null page); None: only the new tokens
    mask: torch.Tensor | None       # [rows, 1, q_len, P*page_size] bool, True = may attend


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [N]
    positions: torch.Tensor      # [N]
    write_slots: torch.Tensor    # [N] pool slot that receives each new token's K and V
    buckets: list[AttentionBucket]
    logits_rows: torch.Tensor    # [M] rows of the flat batch whose next-token logits are wanted
    page_size: int


class LlamaModel:
    def __init__(self, weights: ModelWeights, device: str = "cpu"):
        cfg = weights.config
        self.config: ModelConfig = cfg
        self.dtype = weights.embed.dtype
        self.device = device
        self.embed = weights.embed
        self.lm_head = weights.lm_head if weights.lm_head is not None else weights.embed
        self.final_norm = weights.final_norm
        self.eps = cfg.rms_norm_eps
        # Fused projections: fewer, larger matmuls per layer.
        self.layers = []
        for lw in weights.layers:
            self.layers.append((
                lw.attn_norm,
                torch.cat([lw.q, lw.k, lw.v], 0).contiguous(),
                lw.o.contiguous(),
                lw.ffn_norm,
                torch.cat([lw.gate, lw.up], 0).contiguous(),
                lw.down.contiguous(),
            ))
        weights.layers.clear()  # the fused copies replace them; free the originals
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self._build_rope(cfg.max_context)

    def _build_rope(self, max_pos: int) -> None:
        cfg = self.config
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin = emb.sin().to(self.device, self.dtype)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def _gather_index(pages: torch.Tensor, kv_heads: int, num_pages: int) -> torch.Tensor:
        """Row indices into the pool viewed as [kv_heads * pages, page_size * d], head-major,
        so one flat gather returns [kvh, rows, P*page_size, d]. Flat dim-0 gathers measured
        ~4x faster than index_select on an inner dimension."""
        heads = torch.arange(kv_heads, device=pages.device).view(kv_heads, 1) * num_pages
        return (heads + pages.view(1, -1)).view(-1)

    @staticmethod
    def _gather(cache: torch.Tensor, index: torch.Tensor, rows: int, page_size: int) -> torch.Tensor:
        kvh, slots, d = cache.shape
        g = F.embedding(index, cache.view(kvh * (slots // page_size), page_size * d))
        return g.view(kvh, rows, -1, d)

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [rows, H, q_len, d]; k, v [kvh, rows, T, d]. For short queries (decode), explicit
        grouped matmuls are ~10x faster than the CPU SDPA kernel in bf16; long ones use SDPA."""
        rows, heads, q_len, dim = q.shape
        kvh, t = k.shape[0], k.shape[2]
        if q_len > 8:
            return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                                  enable_gqa=True)
        group = heads // kvh
        qg = q.reshape(rows, kvh, group * q_len, dim).transpose(0, 1).reshape(kvh * rows, group * q_len, dim)
        scores = torch.bmm(qg, k.view(kvh * rows, t, dim).transpose(1, 2)).float()
        scores = scores.view(kvh, rows, group, q_len, t).mul_(dim ** -0.5)
        scores.masked_fill_(~mask.view(1, rows, 1, q_len, t), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kvh * rows, group * q_len, t)
        out = torch.bmm(probs, v.view(kvh * rows, t, dim)).view(kvh, rows, group * q_len, dim)
        return out.transpose(0, 1).reshape(rows, heads, q_len, dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [layers, 2, kv_heads, slots, head_dim] (see kv/pool.py). Returns float32
        logits [M, vocab]."""
        cfg = self.config
        n = batch.input_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        h = self.embed[batch.input_ids]
        attn_out = torch.empty(n, H, D, dtype=self.dtype, device=self.device)
        num_pages = kv_cache.shape[3] // batch.page_size
        gather_index = [None if b.kv_pages is None else self._gather_index(b.kv_pages, KVH, num_pages)
                        for b in batch.buckets]
        for li, (attn_norm, wqkv, wo, ffn_norm, wgu, wdown) in enumerate(self.layers):
            x = self._rms_norm(h, attn_norm)
            qkv = F.linear(x, wqkv)
            # q and k heads sit side by side: rotate them in one go
            qk = self._rotate(qkv[:, : self.q_size + self.kv_size].view(n, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, KVH, D)
            k_cache, v_cache = kv_cache[li, 0], kv_cache[li, 1]
            k_cache.index_copy_(1, batch.write_slots, k.transpose(0, 1))
            v_cache.index_copy_(1, batch.write_slots, v.transpose(0, 1))
            for b, gidx in zip(batch.buckets, gather_index):
                s, e = b.token_start, b.token_start + b.num_rows * b.q_len
                qb = q[s:e].view(b.num_rows, b.q_len, H, D).transpose(1, 2)
                if b.kv_pages is None:
                    kb = k[s:e].view(b.num_rows, b.q_len, KVH, D).transpose(1, 2)
                    vb = v[s:e].view(b.num_rows, b.q_len, KVH, D).transpose(1, 2)
                    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=b.q_len > 1, enable_gqa=True)
                else:
                    o = self._attend_cached(qb, self._gather(k_cache, gidx, b.num_rows, batch.page_size),
                                            self._gather(v_cache, gidx, b.num_rows, batch.page_size), b.mask)
                attn_out[s:e] = o.transpose(1, 2).reshape(e - s, H, D)
            h = h + F.linear(attn_out.view(n, H * D), wo)
            x = self._rms_norm(h, ffn_norm)
            gu = F.linear(x, wgu)
            gate, up = gu.chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, wdown)
        h = self._rms_norm(h[batch.logits_rows], self.final_norm)
        return F.linear(h, self.lm_head).float()
