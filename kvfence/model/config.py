"""Shape of a Llama-family decoder, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_embeddings: bool

    def fingerprint(self) -> str:
        """A short id of the architecture; prefill and decode must agree on it (I5, I8)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
