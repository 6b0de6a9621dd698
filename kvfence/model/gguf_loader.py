"""Load a Llama-family model from a GGUF file: config, dequantized weights, tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import KvTokenizer, tokenizer_from_gguf_metadata
from kvfence.model.weights import LayerWeights, ModelWeights

SUPPORTED_ARCHS = ("llama",)


def _field_value(field):
    """Decode one GGUF metadata field into a Python value (str, number, bool or list)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        inner = types[-1]
        if inner == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == gguf.GGUFValueType.BOOL else value


def read_metadata(path: str | Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving so rotate-half RoPE applies (as in Hugging Face)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict, name: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; kvfence serves {', '.join(SUPPORTED_ARCHS)}")
    p = f"{arch}."
    hidden = meta[p + "embedding_length"]
    heads = meta[p + "attention.head_count"]
    vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta[p + "feed_forward_length"],
        num_layers=meta[p + "block_count"],
        num_heads=heads,
        num_kv_heads=meta.get(p + "attention.head_count_kv", heads),
        head_dim=meta.get(p + "rope.dimension_count", hidden // heads),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=meta.get(p + "context_length", 2048),
        tie_embeddings=False,  # fixed below once we know whether output.weight exists
    )


def load_gguf(path: str | Path, dtype: torch.dtype, device: str = "cpu",
              progress: bool = True) -> tuple[ModelWeights, KvTokenizer]:
    import dataclasses

    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(meta, name=meta.get("general.name") or path.stem)
    cfg = dataclasses.replace(cfg, tie_embeddings="output.weight" not in tensors)

    def load(name: str, unpermute_heads: int | None = None) -> torch.Tensor:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if unpermute_heads:
            arr = _unpermute(arr, unpermute_heads)
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).to(device=device, dtype=dtype)

    bar = tqdm(total=cfg.num_layers + 2, desc=f"loading {path.name}", unit="layer",
               disable=not progress, leave=False)
    embed = load("token_embd.weight")
    bar.update(1)
    layers = []
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=load(b + "attn_norm.weight"),
            q=load(b + "attn_q.weight", cfg.num_heads),
            k=load(b + "attn_k.weight", cfg.num_kv_heads),
            v=load(b + "attn_v.weight"),
            o=load(b + "attn_output.weight"),
            ffn_norm=load(b + "ffn_norm.weight"),
            gate=load(b + "ffn_gate.weight"),
            up=load(b + "ffn_up.weight"),
            down=load(b + "ffn_down.weight"),
        ))
        bar.update(1)
    weights = ModelWeights(config=cfg, embed=embed, layers=layers, final_norm=load("output_norm.weight"),
                           lm_head=None if cfg.tie_embeddings else load("output.weight"))
    bar.update(1)
    bar.close()
    return weights, tokenizer_from_gguf_metadata(meta)
