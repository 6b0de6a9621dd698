"""Logprobs' bytes and completions' text_offset on text whose characters span several tokens
(the bundled tokenizer splits an emoji or a CJK character into byte pieces), with the real
tokenizer and llguidance's view of its vocabulary, as the server builds them."""
from __future__ import annotations

import pytest

from kvfence.engine.grammar import ll_tokenizer
from kvfence.model.gguf_loader import read_metadata
from kvfence.model.loader import default_model_path
from kvfence.model.tokenizer import tokenizer_from_gguf_metadata
from kvfence.server.backend import Logprob
from kvfence.server.openai_format import Formatter

TEXT = "Le café coûte 3€. 日本語のテキスト。🎉🌍 Emoji:"


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf_metadata(read_metadata(default_model_path()))


def _formatter(tok, kind: str) -> Formatter:
    ll = ll_tokenizer(tok)
    return Formatter(kind, "x", "m", "fp", lambda t: tok.decode([t], skip_special_tokens=False),
                     lambda t: ll.decode_bytes([t]))


def test_chat_logprobs_bytes_rebuild_the_text(tok):
    """OpenAI's bytes are the token's own bytes: a client joins them to rebuild the text. A
    token that holds part of a character reported "\\ufffd"'s three bytes instead."""
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in ids)        # the case: partial characters
    lps = [Logprob(t, -0.5, ((t, -0.5),)) for t in ids]
    content = _formatter(tok, "chat")._chat_logprobs(lps)["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == tok.decode(ids)
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


def test_text_offset_counts_the_characters_of_the_text(tok):
    """Each token's offset is the characters before it in the text; one that continues a
    character points at that character. Summing each token's own text ran ahead (a partial
    character counted as one "\\ufffd") and the completion's offsets then went backwards."""
    ids = tok.encode(TEXT)
    prompt = tok.decode(ids)
    gen = tok.encode(" 日本🎉 ok")
    fmt = _formatter(tok, "completion")
    fmt.start_offset(0, len(prompt))
    fmt.prompt_logprobs(0, ids[0], [Logprob(t, -1.0, ()) for t in ids[1:]])
    first = fmt._completion_logprobs([Logprob(t, -1.0, ()) for t in gen[:2]], 0)
    rest = fmt._completion_logprobs([Logprob(t, -1.0, ()) for t in gen[2:]], 0)   # a later stream chunk
    offsets = first["text_offset"] + rest["text_offset"]
    text = prompt + tok.decode(gen)
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    everything = ids + gen
    for k, at in enumerate(offsets):
        before = tok.decode(everything[:k]) if k < len(ids) else prompt + tok.decode(gen[:k - len(ids)])
        assert at == len(before.rstrip("\ufffd")), (k, at)   # complete characters before the token


@pytest.mark.parametrize("top", [(), ((5, -0.1),), ((5, -0.1), (9, -2.0))])
def test_completions_top_logprobs_always_hold_the_chosen_token(tok, top):
    """OpenAI's legacy API (and vLLM) answer up to logprobs + 1 entries: the likeliest and the
    chosen token. With logprobs 0 each entry was {}, so a client taking its argmax failed."""
    fmt = _formatter(tok, "completion")
    fmt.start_offset(0, 0)
    chosen = 7
    got = fmt._completion_logprobs([Logprob(chosen, -3.0, top)], 0)["top_logprobs"][0]
    text = lambda t: tok.decode([t], skip_special_tokens=False)   # noqa: E731
    assert got == {**{text(t): v for t, v in top}, text(chosen): -3.0}
    among = fmt._completion_logprobs([Logprob(5, -0.1, top)], 0)["top_logprobs"][0]
    assert len(among) == max(len(top), 1)   # chosen among the likeliest: not twice
