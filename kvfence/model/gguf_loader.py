"""Load a Llama-family model from a GGUF file: config, dequantized weights, tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import KvTokenizer, tokenizer_from_gguf_metadata
from kvfence.model.weights import ModelWeights, assemble

SUPPORTED_ARCHS = ("llama",)
GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
LAYER_NAMES = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


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

    def tensor(name: str, unpermute_heads: int | None = None) -> torch.Tensor:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if unpermute_heads:
            arr = _unpermute(arr, unpermute_heads)
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).to(device=device, dtype=dtype)

    def load(field: str, layer: int | None) -> torch.Tensor:
        if layer is None:
            return tensor(GLOBAL_NAMES[field])
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}.get(field)
        return tensor(f"blk.{layer}.{LAYER_NAMES[field]}.weight", heads)

    weights = assemble(cfg, load, f"loading {path.name}", progress)
    return weights, tokenizer_from_gguf_metadata(meta)
