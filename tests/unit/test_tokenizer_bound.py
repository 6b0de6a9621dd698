"""KvTokenizer.fewest_tokens: a lower bound on a text's token count from its length, used to
refuse a text far too long for the context without tokenizing it. It must never exceed the
real count (or a prompt that fits would be refused)."""
from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

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
    stripping = build()
    stripping.add_special_tokens([AddedToken("<x>", lstrip=True, rstrip=True)])
    assert len(stripping.encode("<x>" + " " * 1000 + "<x>").ids) == 2    # a long run of spaces, absorbed
    assert _max_token_chars(stripping) is None
    dropping = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))            # no unk, no byte fallback
    assert len(dropping.encode("a" + "z" * 1000).ids) == 1                # unknown characters vanish
    assert _max_token_chars(dropping) is None
    kv = KvTokenizer(TokenizerInfo(tokenizer=build(pre=pre_tokenizers.WhitespaceSplit()), bos_id=None, eos_id=None,
                                   add_bos=False, chat_template=None, bos_token="", eos_token=""))
    assert kv.fewest_tokens("a" * 1000) == 0       # no bound: everything is tokenized


def test_a_tokenizer_json_that_truncates_does_not_cut_prompts_short(tmp_path):
    """A truncation setting in tokenizer.json would cut a long prompt short before I4 saw it."""
    from kvfence.model.tokenizer import tokenizer_from_hf_folder

    t = Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], unk_token="[UNK]"))
    t.enable_truncation(max_length=8)
    t.save(str(tmp_path / "tokenizer.json"))
    assert len(Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("a" * 50).ids) == 8
    assert len(tokenizer_from_hf_folder(tmp_path).encode("a" * 50)) == 50
