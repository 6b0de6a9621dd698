"""Load a Llama-family model from a Hugging Face folder (config.json + safetensors + tokenizer.json)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import KvTokenizer, tokenizer_from_hf_folder
from kvfence.model.weights import ModelWeights, assemble

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")
GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _rope_theta(cfg: dict) -> float:
    """transformers < 5 writes `rope_theta` (and `rope_scaling`); 5.x writes
    `rope_parameters: {rope_type, rope_theta, ...}` instead. Only plain RoPE is supported."""
    params = cfg.get("rope_parameters") or {}
    for p in (params, cfg.get("rope_scaling") or {}):
        if not isinstance(p, dict) or p.get("rope_type", p.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {p!r} is not supported yet")
    if params and "rope_theta" not in params:  # e.g. per-layer-type parameters
        raise ValueError(f"rope parameters {params!r} are not supported yet")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED for a in archs):
        raise ValueError(f"unsupported architecture {archs}; kvfence serves {', '.join(SUPPORTED)}")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        name=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=_rope_theta(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_context=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        wmap = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in wmap.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def load_hf_folder(folder: str | Path, dtype: torch.dtype, device: str = "cpu",
                   progress: bool = True) -> tuple[ModelWeights, KvTokenizer]:
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    cfg = config_from_hf(raw, name=folder.name)
    where = _tensor_files(folder)
    handles: dict[Path, object] = {}

    def tensor(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name).to(device=device, dtype=dtype).contiguous()

    def load(field: str, layer: int | None) -> torch.Tensor:
        if layer is None:
            return tensor(GLOBAL_NAMES[field])
        return tensor(f"model.layers.{layer}.{LAYER_NAMES[field]}.weight")

    if "lm_head.weight" not in where:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    weights = assemble(cfg, load, f"loading {folder.name}", progress)
    return weights, tokenizer_from_hf_folder(folder)
