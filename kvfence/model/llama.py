"""Llama-family decoder over a paged KV cache: token ids in, logits out.

The forward pass takes a flat batch of tokens from many sequences. Linear layers run on
the flat batch; attention reads keys and values from the pool through the page tables and
lengths in `AttentionRows`, which the runner built from block tables the ledger had just
checked (I2, I3). The model never decides which slots a sequence may read.

Two implementations of the same arithmetic: fused CPU kernels (kvfence/kernels) where they
are built, plain torch ops elsewhere (CUDA, no compiler, KVFENCE_KERNELS=0). The fused loop
runs from Python (`_layers_fused`), or, for bf16 where every matmul is kvfence's, as one call
into kernels/stack.cpp that runs the same kernels in the same order (bit-identical, tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.kernels import MAX_PAGE_SIZE, DecoderStack, cpu_kernels, supports
from kvfence.kv.pool import k_pages, v_pages
from kvfence.model.config import ModelConfig
from kvfence.model.linear import Linear, SwiGLU, resolve_matmul
from kvfence.model.quant import cat_rows
from kvfence.model.weights import ModelWeights


@dataclass
class AttentionRows:
    """One row per sequence in the batch. Row r's q_len[r] new tokens sit at flat positions
    q_start[r] ..; its keys are positions 0 .. kv_len[r]-1 on pages[r] (padded with the
    null page); query i of the row sees keys 0 .. kv_len[r] - q_len[r] + i."""
    q_start: torch.Tensor   # [R] int64
    q_len: torch.Tensor     # [R] int64
    kv_len: torch.Tensor    # [R] int64
    pages: torch.Tensor     # [R, P] int64

    def visible(self, page_size: int) -> torch.Tensor:
        """[R, P*page_size] bool: the pool positions any query of the row may read."""
        pos = torch.arange(self.pages.shape[1] * page_size, device=self.pages.device)
        return pos[None, :] < self.kv_len[:, None]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [N]
    positions: torch.Tensor      # [N]
    write_slots: torch.Tensor    # [N] pool slot that receives each new token's K and V
    attn: AttentionRows
    logits_rows: torch.Tensor    # [M] rows of the flat batch whose next-token logits are wanted
    page_size: int


class LlamaModel:
    def __init__(self, weights: ModelWeights, device: str = "cpu", matmul: str = "auto"):
        cfg = weights.config
        # whose bf16 matmul runs the layers on CPU (linear.resolve_matmul): kvfence's, or
        # oneDNN's on AMX; the LM head is kvfence's either way
        self.matmul = resolve_matmul(matmul) if device == "cpu" else "kvfence"
        mm = self.matmul
        self.config: ModelConfig = cfg
        self.dtype = weights.embed.dtype
        self.device = device
        self.embed = weights.embed
        # float32 logits: bf16 ones are multiples of 1/8 here, and near-ties became exact (#16)
        dt = self.dtype
        self.lm_head = Linear(weights.lm_head if weights.lm_head is not None else weights.embed, float_out=True,
                              dtype=dt)
        self.final_norm = weights.final_norm
        self.eps = cfg.rms_norm_eps
        # Fused projections: fewer, larger matmuls per layer.
        self.layers = []
        for lw in weights.layers:
            self.layers.append((
                lw.attn_norm,
                Linear(cat_rows([lw.q, lw.k, lw.v], dt), dtype=dt, matmul=mm),
                Linear(lw.o, dtype=dt, matmul=mm),
                lw.ffn_norm,
                SwiGLU(lw.gate, lw.up, dtype=dt, matmul=mm),
                Linear(lw.down, dtype=dt, matmul=mm),
            ))
        weights.layers.clear()  # the fused copies replace them; free the originals
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self._build_rope(cfg.max_context)
        self.kernels = cpu_kernels() if supports(self.dtype, device, cfg.head_dim) else None
        self.stack = self._decoder_stack()

    def layer_backends(self) -> set[str]:
        """Whose matmuls run the decoder layers: kvfence, native, onednn or torch."""
        return {m.backend for _, qkv, o, _, mlp_in, down in self.layers for m in (qkv, o, mlp_in, down)}

    @property
    def weights_mode(self) -> str:
        """What the matmuls really run: native (every one over GGUF blocks), bf16 (none), or
        mixed (--weights native fell back for some: no AVX2, a failed probe, another type)."""
        backends = self.layer_backends()
        backends.add(self.lm_head.backend)
        if backends == {"native"}:
            return "native"
        return "mixed" if "native" in backends else "bf16"

    def _decoder_stack(self) -> DecoderStack | None:
        """The layers as one kernel call, where every matmul is kvfence's (bf16 on AVX512-BF16 or AVX2),
        or every one is the native matmul over GGUF blocks."""
        if self.kernels is None or self.dtype != torch.bfloat16:
            return None
        backends = self.layer_backends()
        if backends not in ({"kvfence"}, {"native"}):
            return None
        native = backends == {"native"}
        cfg = self.config
        layers = [(attn_norm, qkv.weight, o.weight, ffn_norm, mlp_in.native if native else mlp_in.gated, down.weight)
                  for attn_norm, qkv, o, ffn_norm, mlp_in, down in self.layers]
        return DecoderStack(self.kernels, layers, self.final_norm, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size, self.eps, native=native)

    def _build_rope(self, max_pos: int) -> None:
        cfg = self.config
        dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
        inv_freq = 1.0 / (cfg.rope_theta ** (dims / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype).contiguous()
        self.sin = emb.sin().to(self.device, self.dtype).contiguous()

    def runs_fused(self, fused: bool, device_type: str, page_size: int) -> bool:
        """Whether forward takes the fused CPU kernels for a pool on this device and page size."""
        return fused and self.kernels is not None and device_type == "cpu" and page_size <= MAX_PAGE_SIZE

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """kv_cache: [layers, 2, kv_heads, slots, head_dim], pages in the paired layout of
        kv/pool.py. fused: use the CPU kernels where they are built. Returns float32 logits
        [M, vocab]."""
        if self.runs_fused(fused, kv_cache.device.type, batch.page_size):
            h = self._layers_fused(batch, kv_cache) if self.stack is None else self._layers_stacked(batch, kv_cache)
        else:
            h = self._layers_torch(batch, kv_cache)
        if not len(h):  # a pass that only writes KV (a PD prefill, a chunk mid-prompt)
            return torch.empty(0, self.config.vocab_size, device=h.device)
        return self.lm_head(h)

    # -- fused CPU kernels --------------------------------------------------------------
    def _layers_stacked(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """What _layers_fused computes, as one call into kernels/stack.cpp."""
        a = batch.attn
        return self.stack.run(self.embed[batch.input_ids].float(), batch.positions, batch.write_slots, self.cos,
                              self.sin, kv_cache, a.pages, a.q_start, a.q_len, a.kv_len, batch.logits_rows,
                              batch.page_size)

    def _layers_fused(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The decoder stack through kvfence/kernels; returns the final-normed hidden
        states of the logits rows."""
        K, cfg, a = self.kernels, self.config, batch.attn
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n = batch.input_ids.shape[0]
        # a bf16 model's residual stream is float32 (CpuKernels.add_rms_norm_f32res says why)
        bf16 = self.dtype == torch.bfloat16
        h = self.embed[batch.input_ids].float() if bf16 else self.embed[batch.input_ids]
        norm = K.add_rms_norm_f32res if bf16 else K.add_rms_norm
        attn_out = torch.empty(n, H, D, dtype=self.dtype)
        scale = D ** -0.5
        x = norm(h, None, self.layers[0][0], self.eps)
        last, rows = len(self.layers) - 1, batch.logits_rows
        for li, (_, wqkv, wo, ffn_norm, mlp_in, wdown) in enumerate(self.layers):
            qkv = wqkv(x)
            k_cache, v_cache = kv_cache[li, 0], kv_cache[li, 1]
            K.rope_store(qkv, H, KVH, D, batch.positions, self.cos, self.sin, k_cache, v_cache,
                         batch.write_slots, batch.page_size)
            q = qkv[:, :self.q_size].view(n, H, D)
            K.paged_attention(q, k_cache, v_cache, a.pages, a.q_start, a.q_len, a.kv_len, attn_out,
                              batch.page_size, scale)
            attn = attn_out
            if li == last:  # past the last KV write, only the logits rows matter
                h, attn = h[rows], attn_out[rows]
                if not len(rows):
                    return h
            x = norm(h, wo(attn.view(-1, H * D)), ffn_norm, self.eps)
            down = wdown(mlp_in(x))
            nxt = self.layers[li + 1][0] if li + 1 < len(self.layers) else None
            if nxt is not None:
                x = norm(h, down, nxt, self.eps)
            else:
                return norm(h, down, self.final_norm, self.eps)
        return norm(h, None, self.final_norm, self.eps)

    # -- plain torch ---------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(w.dtype)   # x may be a bf16 model's float32 residual; w is the model's dtype

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def _buckets(a: AttentionRows) -> list[tuple[int, int, bool]]:
        """Consecutive rows the torch path can attend in one go: (first row, rows, fresh),
        same q_len, and for prefills all fresh (no cached keys) or all not."""
        q_len, kv_len = a.q_len.tolist(), a.kv_len.tolist()
        out, i = [], 0
        while i < len(q_len):
            fresh = kv_len[i] == q_len[i] and q_len[i] > 1
            j = i
            while (j + 1 < len(q_len) and q_len[j + 1] == q_len[i]
                   and (q_len[i] == 1 or (kv_len[j + 1] == q_len[j + 1]) == fresh)):
                j += 1
            out.append((i, j - i + 1, fresh))
            i = j + 1
        return out

    @staticmethod
    def _store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: torch.Tensor, page_size: int) -> None:
        """k, v [n, kv_heads, dim] into their slots, in the pool's paired in-page layout."""
        n, kvh, d = k.shape
        page, j = slots // page_size, slots % page_size
        k_pages(k_cache, page_size)[:, page, :, j, :] = k.view(n, kvh, d // 2, 2)
        v_pages(v_cache, page_size)[:, page, j // 2, :, j % 2] = v

    @staticmethod
    def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pages [rows, P] as [kv_heads, rows, P*page_size, dim] each:
        one flat dim-0 gather per plane (measured ~4x faster than index_select on an inner
        dimension), then the pairs undone."""
        kvh, total, d = k_cache.shape
        num_pages = total // page_size
        rows, p = pages.shape
        heads = torch.arange(kvh, device=pages.device).view(kvh, 1) * num_pages
        index = (heads + pages.reshape(1, -1)).view(-1)
        # a K pair moves as one element of twice the width: [d/2, page] -> [page, d/2] is then a
        # plain transpose (a pair-by-pair permute measured ~3x slower)
        pair = {2: torch.int32, 4: torch.int64}[k_cache.element_size()]
        k = F.embedding(index, k_cache.view(kvh * num_pages, d * page_size).view(pair))
        k = k.view(kvh, rows, p, d // 2, page_size).transpose(-1, -2).contiguous().view(k_cache.dtype)
        v = F.embedding(index, v_cache.view(kvh * num_pages, page_size * d))
        v = v.view(kvh, rows, p, page_size // 2, d, 2).transpose(-1, -2).reshape(kvh, rows, p * page_size, d)
        return k.view(kvh, rows, p * page_size, d), v

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
        scores = torch.bmm(qg, k.reshape(kvh * rows, t, dim).transpose(1, 2)).float()
        scores = scores.view(kvh, rows, group, q_len, t).mul_(dim ** -0.5)
        scores.masked_fill_(~mask.view(1, rows, 1, q_len, t), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kvh * rows, group * q_len, t)
        out = torch.bmm(probs, v.reshape(kvh * rows, t, dim)).view(kvh, rows, group * q_len, dim)
        return out.transpose(0, 1).reshape(rows, heads, q_len, dim)

    def _layers_torch(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        cfg, a, ps = self.config, batch.attn, batch.page_size
        n = batch.input_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        h = self.embed[batch.input_ids].float()   # the residual stream is float32 (add_rms_norm_f32res)
        attn_out = torch.empty(n, H, D, dtype=self.dtype, device=self.device)
        plan = []
        q_start, q_len, kv_len = a.q_start.tolist(), a.q_len.tolist(), a.kv_len.tolist()
        for first, rows, fresh in self._buckets(a):
            ql = q_len[first]
            s, e = q_start[first], q_start[first] + rows * ql
            if fresh:
                plan.append((s, e, rows, ql, None, None))
                continue
            # the widest row decides the page count; shorter rows' extra columns are masked
            p = -(-max(kv_len[first:first + rows]) // ps)
            pages = a.pages[first:first + rows, :p]
            pos = torch.arange(p * ps, device=pages.device)
            ctx = a.kv_len[first:first + rows] - ql
            mask = pos[None, None, :] <= (ctx[:, None, None] + torch.arange(ql, device=pages.device)[None, :, None])
            plan.append((s, e, rows, ql, pages, mask.unsqueeze(1)))
        last = len(self.layers) - 1
        for li, (attn_norm, wqkv, wo, ffn_norm, mlp_in, wdown) in enumerate(self.layers):
            x = self._rms_norm(h, attn_norm)
            qkv = wqkv(x)
            # q and k heads sit side by side: rotate them in one go
            qk = self._rotate(qkv[:, : self.q_size + self.kv_size].view(n, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, KVH, D)
            k_cache, v_cache = kv_cache[li, 0], kv_cache[li, 1]
            self._store(k_cache, v_cache, k, v, batch.write_slots, ps)
            for s, e, rows, ql, pages, mask in plan:
                qb = q[s:e].view(rows, ql, H, D).transpose(1, 2)
                if pages is None:  # fresh prefill: only this pass's own keys
                    kb = k[s:e].view(rows, ql, KVH, D).transpose(1, 2)
                    vb = v[s:e].view(rows, ql, KVH, D).transpose(1, 2)
                    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                else:
                    kb, vb = self._gather(k_cache, v_cache, pages, ps)
                    o = self._attend_cached(qb, kb, vb, mask)
                attn_out[s:e] = o.transpose(1, 2).reshape(e - s, H, D)
            attn = attn_out
            if li == last:  # past the last KV write, only the logits rows matter
                h, attn = h[batch.logits_rows], attn_out[batch.logits_rows]
                if not len(h):
                    return h
            h = h + wo(attn.view(-1, H * D))
            h = h + wdown(mlp_in(self._rms_norm(h, ffn_norm)))
        return self._rms_norm(h, self.final_norm)
