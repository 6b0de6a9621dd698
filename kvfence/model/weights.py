"""The weights a Llama-family decoder needs, named independently of any file format."""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvfence.model.config import ModelConfig
from kvfence.model.quant import Weight


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: Weight      # [num_heads * head_dim, hidden], Hugging Face (rotate-half) row order
    k: Weight      # [num_kv_heads * head_dim, hidden]
    v: Weight
    o: Weight
    ffn_norm: torch.Tensor
    gate: Weight
    up: Weight
    down: Weight


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor                 # [vocab, hidden]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor | None = None
    lm_head: Weight | None = None  # None when tied to the embedding (native: its blocks, tied or not)


LAYER_FIELDS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")


def assemble(config: ModelConfig, load: Callable[[str, int | None], Weight | None], desc: str,
             progress: bool = True) -> ModelWeights:
    """Build ModelWeights through a format's `load(field, layer)`: field is one of
    LAYER_FIELDS (layer set) or embed / final_norm / lm_head (layer None; lm_head may be
    None when tied). Shows a progress bar, one tick per layer, on a terminal only: in a log
    file its carriage returns glued the next log line onto it."""
    shown = progress and sys.stderr.isatty()
    bar = tqdm(total=config.num_layers + 2, desc=desc, unit="layer", disable=not shown, leave=False)
    embed = load("embed", None)
    bar.update(1)
    layers = []
    for i in range(config.num_layers):
        layers.append(LayerWeights(**{f: load(f, i) for f in LAYER_FIELDS}))
        bar.update(1)
    weights = ModelWeights(config=config, embed=embed, layers=layers, final_norm=load("final_norm", None),
                           lm_head=None if config.tie_embeddings else load("lm_head", None))
    bar.update(1)
    bar.close()
    return weights
