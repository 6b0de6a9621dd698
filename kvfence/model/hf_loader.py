"""Load a Llama-family model from a Hugging Face folder (config.json + safetensors + tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import KvTokenizer, tokenizer_from_hf_folder
from kvfence.model.weights import LayerWeights, ModelWeights

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED for a in archs):
        raise ValueError(f"unsupported architecture {archs}; kvfence serves {', '.join(SUPPORTED)}")
    if cfg.get("rope_scaling"):
        raise ValueError("rope_scaling is not supported yet")
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
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
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

    def load(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name).to(device=device, dtype=dtype).contiguous()

    bar = tqdm(total=cfg.num_layers + 2, desc=f"loading {folder.name}", unit="layer",
               disable=not progress, leave=False)
    embed = load("model.embed_tokens.weight")
    bar.update(1)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=load(p + "input_layernorm.weight"),
            q=load(p + "self_attn.q_proj.weight"),
            k=load(p + "self_attn.k_proj.weight"),
            v=load(p + "self_attn.v_proj.weight"),
            o=load(p + "self_attn.o_proj.weight"),
            ffn_norm=load(p + "post_attention_layernorm.weight"),
            gate=load(p + "mlp.gate_proj.weight"),
            up=load(p + "mlp.up_proj.weight"),
            down=load(p + "mlp.down_proj.weight"),
        ))
        bar.update(1)
    tied = cfg.tie_embeddings or "lm_head.weight" not in where
    weights = ModelWeights(config=cfg, embed=embed, layers=layers, final_norm=load("model.norm.weight"),
                           lm_head=None if tied else load("lm_head.weight"))
    bar.update(1)
    bar.close()
    return weights, tokenizer_from_hf_folder(folder)
