"""The weights a Llama-family decoder needs, named independently of any file format."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfence.model.config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor      # [num_heads * head_dim, hidden], Hugging Face (rotate-half) row order
    k: torch.Tensor      # [num_kv_heads * head_dim, hidden]
    v: torch.Tensor
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor                 # [vocab, hidden]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None  # None when tied to the embedding
