"""Tokenizer rebuilt from GGUF metadata, checked against transformers' own GGUF tokenizer."""
from __future__ import annotations

import pytest

from kvfence.model.gguf_loader import read_metadata
from kvfence.model.loader import default_model_path
from kvfence.model.tokenizer import ChatTemplateError, tokenizer_from_gguf_metadata

TEXTS = ["Hello world", "12345 apples cost $3.50", "  leading spaces\n\nnew lines\t tabs",
         "héllo wörld 日本語 🎉", "<|im_start|>user\nhi<|im_end|>", "don't you'll I'm", "x=1+2*3;print(x)", ""]


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf_metadata(read_metadata(default_model_path()))


def test_encoding_matches_transformers(tok):
    from transformers import AutoTokenizer

    p = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    for t in TEXTS:
        assert tok.encode(t, add_special=False) == ref.encode(t, add_special_tokens=False), t
        assert tok.decode(tok.encode(t, add_special=False), skip_special_tokens=False) == t


def test_bos_follows_gguf_metadata(tok):
    # this GGUF says add_bos_token = false, as the original tokenizer.json does
    assert not tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.encode("hi") == tok.encode("hi", add_special=False)
    tok.add_bos = True
    try:
        assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special=False)[0] != 1
    finally:
        tok.add_bos = False


def test_end_of_turn_tokens_end_generation(tok):
    assert tok.hf.token_to_id("<|im_end|>") in tok.end_ids
    assert tok.hf.token_to_id("<|endoftext|>") in tok.end_ids


def test_chat_template_renders_and_is_sandboxed(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tok.bos_id) == text.count("<|im_start|>")  # no BOS added twice
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"content": "no role"}])


def test_a_template_that_cannot_take_the_messages_is_a_client_error(tok):
    """Qwen3-Coder's template walks a call's arguments with `|items`; a call sent back with arguments
    that are not a JSON object (cut by max_tokens) reaches it as a string, and jinja2's filter raises
    TypeError: that is a 400 naming the template, not a 500."""
    from kvfence.model.tokenizer import KvTokenizer, TokenizerInfo

    qwen_like = KvTokenizer(TokenizerInfo(tokenizer=tok.hf, bos_id=None, eos_id=None, add_bos=False, chat_template=(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.arguments|items %}"
        "{{ k }}={{ v }}{% endfor %}{% endfor %}{{ m.content }}{% endfor %}")))
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "f", "arguments": {"x": 1}}]}
    assert qwen_like.apply_chat_template([call], add_generation_prompt=False) == "x=1"
    cut = {**call, "tool_calls": [{**call["tool_calls"][0], "arguments": '{"x": '}]}
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        qwen_like.apply_chat_template([cut], add_generation_prompt=False)


def test_hostile_template_cannot_reach_python(tok):
    from kvfence.model.tokenizer import KvTokenizer, TokenizerInfo

    evil = KvTokenizer(TokenizerInfo(tokenizer=tok.hf, bos_id=None, eos_id=None, add_bos=False,
                                     chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
