"""KvTokenizer.fewest_tokens: a lower bound on a text's token count from its length, used to
refuse a text far too long for the context without tokenizing it. It must never exceed the
real count (or a prompt that fits would be refused)."""
from __future__ import annotations

import random

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvfence.model.tokenizer import KvTokenizer, TokenizerInfo, _max_token_chars


def test_the_bound_never_exceeds_the_real_count(loaded_fp32):
    tok = loaded_fp32.tokenizer
    assert tok.max_token_chars and tok.max_token_chars >= 16
    rng = random.Random(7)
    longest = max(tok.hf.get_vocab(with_added_tokens=True), key=len)
    pieces = ["#" * 200, " " * 300, "\n" + " " * 100, "=" * 120, "héllo wörld ", "日本語のテキスト", "🙂" * 40,
              "<|im_start|>", "<|im_end|>", "12345678901234", "the quick brown fox ", "\t\t\t", longest]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        assert tok.fewest_tokens(text) <= len(tok.encode(text, add_special=False)), text[:80]


def test_no_bound_where_the_tokenizer_may_drop_characters():
    def build(pre=None, norm=None, fuse_unk=False):
        t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], unk_token="[UNK]", fuse_unk=fuse_unk))
        if pre is not None:
            t.pre_tokenizer = pre
        if norm is not None:
            t.normalizer = norm
        return t

    assert _max_token_chars(build()) == 5          # "[UNK]"
    assert _max_token_chars(build(pre=pre_tokenizers.WhitespaceSplit())) is None    # drops spaces
    assert _max_token_chars(build(pre=pre_tokenizers.Split(" ", behavior="removed"))) is None
    assert _max_token_chars(build(norm=normalizers.Strip())) is None
    assert _max_token_chars(build(fuse_unk=True)) is None     # a run of unknown characters is one token
    kv = KvTokenizer(TokenizerInfo(tokenizer=build(pre=pre_tokenizers.WhitespaceSplit()), bos_id=None, eos_id=None,
                                   add_bos=False, chat_template=None, bos_token="", eos_token=""))
    assert kv.fewest_tokens("a" * 1000) == 0       # no bound: everything is tokenized
