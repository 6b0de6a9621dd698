"""A tiny random Llama for the simulation: the real LlamaModel, weights small enough that
an engine step costs about a millisecond, so thousands of request lives fit in a CI run.

The numbers it produces are meaningless; what matters is that every request runs through
the real scheduler, ledger, runner, read audit, sampler and detokenizer, and that its KV
bytes are distinct per token and position, so a page that holds someone else's data is a
different byte pattern (the simulation's content oracle compares bytes).
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvfence.model.config import ModelConfig
from kvfence.model.llama import LlamaModel
from kvfence.model.weights import LayerWeights, ModelWeights

VOCAB = 256
EOS_ID = 1


def tiny_config(layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = VOCAB,
                max_context: int = 512) -> ModelConfig:
    return ModelConfig(name="kvfence-sim-tiny", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rope_theta=10000.0, rms_norm_eps=1e-5, max_context=max_context, tie_embeddings=True)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> ModelWeights:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    h, d = cfg.hidden_size, cfg.head_dim
    layers = [LayerWeights(attn_norm=torch.ones(h), q=rnd(cfg.num_heads * d, h), k=rnd(cfg.num_kv_heads * d, h),
                           v=rnd(cfg.num_kv_heads * d, h), o=rnd(h, cfg.num_heads * d), ffn_norm=torch.ones(h),
                           gate=rnd(cfg.intermediate_size, h), up=rnd(cfg.intermediate_size, h),
                           down=rnd(h, cfg.intermediate_size))
              for _ in range(cfg.num_layers)]
    return ModelWeights(config=cfg, embed=rnd(cfg.vocab_size, h, scale=1.0), layers=layers,
                        final_norm=torch.ones(h), lm_head=None)


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over t0 .. t{vocab-1}; t1 is the end-of-sequence token, so
    some generations stop early (finish_reason "stop")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from kvfence.model.tokenizer import KvTokenizer, TokenizerInfo

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return KvTokenizer(TokenizerInfo(tokenizer=t, bos_id=None, eos_id=EOS_ID, add_bos=False, chat_template=None))


def tiny_loaded(layers: int = 1, hidden: int = 32, seed: int = 0):
    """A LoadedModel that any number of LLMEngines can share (crash/restart builds new engines on it)."""
    from kvfence.engine.llm_engine import LoadedModel

    cfg = tiny_config(layers=layers, hidden=hidden)
    return LoadedModel(LlamaModel(tiny_weights(cfg, seed), "cpu"), tiny_tokenizer(cfg.vocab_size),
                       Path("kvfence-sim-tiny"))
