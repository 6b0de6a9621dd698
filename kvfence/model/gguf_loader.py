"""Load a Llama-family model from a GGUF file: config, dequantized weights, tokenizer.

native=True keeps the matmul weights of the types kernels/qgemm.cpp takes (Q4_0, Q4_1, Q8_0)
in their GGUF blocks (model/quant.py's QuantWeight), q and k rows unpermuted block-row by
block-row; the embeddings are still dequantized (a bf16 copy: a lookup reads a few rows), and
when they are tied to the LM head their blocks are kept too, for it."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from kvfence.model.config import ModelConfig
from kvfence.model.quant import NATIVE_TYPES, QuantWeight, Weight
from kvfence.model.tokenizer import KvTokenizer, tokenizer_from_gguf_metadata
from kvfence.model.weights import ModelWeights, assemble

SUPPORTED_ARCHS = ("llama",)
GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
LAYER_NAMES = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


@functools.cache
def _reader_class():
    """gguf.GGUFReader, reading its header through a plain ndarray view of the file's mmap.

    The stock reader slices an np.memmap once per value: ~250,000 slices for this model's
    vocabulary and merges, each paying memmap's __getitem__/__array_finalize__, which made
    opening the 80 MB bundled file take ~5 s of a ~9 s model load (every node start pays it).
    A plain view of the same mapping reads the same bytes with no copy, in about a third of
    the time. Same fields and tensors: tests/unit/test_gguf_reader.py compares the two."""
    import gguf

    class MappedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return MappedReader


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over `path` (fields and tensors as the library defines them)."""
    return _reader_class()(str(path))


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
    reader = open_gguf(path)
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
              progress: bool = True, native: bool = False) -> tuple[ModelWeights, KvTokenizer]:
    import dataclasses

    import gguf

    path = Path(path)
    reader = open_gguf(path)
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

    def blocks(name: str, unpermute_heads: int | None = None) -> QuantWeight | None:
        t = tensors[name]
        if int(t.tensor_type) not in NATIVE_TYPES or len(t.shape) != 2:
            return None
        data = np.asarray(t.data)  # [rows, row bytes]: a row's blocks move with it
        if unpermute_heads:
            data = _unpermute(data, unpermute_heads)
        return QuantWeight(int(t.tensor_type), data.shape[0], int(t.shape[0]), data)

    def load(field: str, layer: int | None) -> Weight:
        if layer is None:
            name = GLOBAL_NAMES[field]
            if native and field == "lm_head":
                return blocks(name) or tensor(name)
            return tensor(name)
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}.get(field)
        name = f"blk.{layer}.{LAYER_NAMES[field]}.weight"
        if native and field not in ("attn_norm", "ffn_norm"):
            return blocks(name, heads) or tensor(name, heads)
        return tensor(name, heads)

    if native and (dtype != torch.bfloat16 or torch.device(device).type != "cpu"):
        raise ValueError("native GGUF weights run on the CPU with bfloat16 activations; use dtype bfloat16")
    weights = assemble(cfg, load, f"loading {path.name}", progress)
    if native and cfg.tie_embeddings:
        weights.lm_head = blocks(GLOBAL_NAMES["embed"])
    return weights, tokenizer_from_gguf_metadata(meta)
