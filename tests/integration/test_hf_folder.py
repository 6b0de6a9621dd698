"""Loading from a Hugging Face folder (config.json + safetensors + tokenizer.json).

The folder is written by the test from the bundled GGUF (no downloads), then loaded by
kvfence and by transformers; all three must agree."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvfence import LLM, SamplingParams
from kvfence.model.gguf_loader import load_gguf, read_metadata
from kvfence.model.loader import default_model_path


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    w, tok = load_gguf(default_model_path(), torch.float32, progress=False)
    c = w.config
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": lw.attn_norm, p + "self_attn.q_proj.weight": lw.q,
                        p + "self_attn.k_proj.weight": lw.k, p + "self_attn.v_proj.weight": lw.v,
                        p + "self_attn.o_proj.weight": lw.o, p + "post_attention_layernorm.weight": lw.ffn_norm,
                        p + "mlp.gate_proj.weight": lw.gate, p + "mlp.up_proj.weight": lw.up,
                        p + "mlp.down_proj.weight": lw.down})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_context, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}))
    tok.hf.save(str(out / "tokenizer.json"))
    meta = read_metadata(default_model_path())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": meta["tokenizer.chat_template"]}))
    return out


def test_hf_folder_matches_gguf_and_transformers(hf_folder, make_llm):
    from transformers import AutoModelForCausalLM

    folder_llm = LLM(model=str(hf_folder), dtype="float32", kv_cache_memory="64MiB", clamp_context=True,
                     progress=False)
    gguf_llm = make_llm()
    prompt = "The three primary colours are"
    ids = folder_llm.tokenizer.encode(prompt)
    assert ids == gguf_llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a = folder_llm.generate([prompt], params)[0]
    b = gguf_llm.generate([prompt], params)[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    ref = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                           pad_token_id=0)
    assert out[0, len(ids):].tolist() == a.token_ids
    chat = folder_llm.chat([{"role": "user", "content": "Say hi"}], params)[0]
    assert chat.finish_reason in ("stop", "length") and chat.token_ids


def test_missing_or_unsupported_model_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        LLM(model=str(tmp_path / "nope.gguf"), progress=False)
    with pytest.raises(FileNotFoundError, match="without config.json"):
        LLM(model=str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path), progress=False)
