"""IncrementalDetokenizer against real byte-level BPE tokenizers built in the test."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvfence.engine.detokenizer import IncrementalDetokenizer
from kvfence.engine.params import SamplingParams

CORPUS = [
    "héllo wörld 日本語 🎉 naïve café",
    "hello world, the quick brown fox jumps over the lazy dog",
    "日本語のテキスト 🎉🎉 émoji 👩‍👩‍👧 and Ελληνικά",
] * 20

TEXTS = [
    "héllo wörld 日本語 🎉",
    "The quick brown fox says 👋🏽 to 日本語のテキスト!",
    "naïve café — Ελληνικά, 😀😃 end",
    "plain ascii only",
]


def _tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|eos|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    """No merges: every token is one byte, so every multi-byte character is split."""
    tok = _tokenizer(257)
    assert tok.get_vocab_size() == 257
    return tok


@pytest.fixture(scope="module")
def bpe_tok() -> Tokenizer:
    """Some merges: tokens mix whole characters, partial characters and bytes."""
    return _tokenizer(300)


def _stream(tok, prompt_ids, out_ids, params=None):
    detok = IncrementalDetokenizer(tok, prompt_ids, params or SamplingParams())
    deltas = [detok.add(t) for t in out_ids]
    tail = detok.flush()
    return detok, deltas, tail


def test_emoji_split_across_byte_tokens_is_held_until_complete(byte_tok):
    ids = byte_tok.encode("a🎉b").ids
    assert len(ids) == 6  # 'a', four emoji bytes, 'b'
    _, deltas, tail = _stream(byte_tok, [], ids)
    assert deltas == ["a", "", "", "", "🎉", "b"]
    assert tail == ""


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["byte_tok", "bpe_tok"])
def test_valid_text_streams_exactly_without_replacement_chars(request, which, text):
    tok = request.getfixturevalue(which)
    prompt = tok.encode("Prompt: 日本").ids
    ids = tok.encode(text).ids
    detok, deltas, tail = _stream(tok, prompt, ids)
    assert "".join(deltas) + tail == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == text


@pytest.mark.parametrize("which", ["byte_tok", "bpe_tok"])
def test_random_token_sequences_match_full_decode(request, which):
    tok = request.getfixturevalue(which)
    vocab = tok.get_vocab_size()
    rng = random.Random(1234)
    saw_replacement = saw_clean_multibyte = False
    for trial in range(300):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(0, 8))]
        if trial % 2:
            # Valid text, so full decode has no U+FFFD but characters split across tokens.
            out = tok.encode(rng.choice(TEXTS)[rng.randrange(0, 5):]).ids
        else:
            out = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 30))]
        detok, deltas, tail = _stream(tok, prompt, out)
        full = tok.decode(out)
        assert "".join(deltas) + tail == full, (prompt, out)
        assert detok.text == full
        if "\ufffd" in full:
            saw_replacement = True
        else:
            assert all("\ufffd" not in d for d in deltas), (prompt, out, deltas)
            saw_clean_multibyte |= any(ord(c) > 127 for c in full)
    assert saw_replacement and saw_clean_multibyte  # both regimes were exercised


def test_prompt_ending_inside_a_character_does_not_corrupt_output(byte_tok):
    ids = byte_tok.encode("日本").ids  # six byte tokens
    _, deltas, tail = _stream(byte_tok, ids[:4], ids[4:] + byte_tok.encode(" ok").ids)
    # Output is decoded on its own: the two orphan continuation bytes become U+FFFD.
    assert "".join(deltas) + tail == byte_tok.decode(ids[4:]) + " ok"


def test_first_token_keeps_leading_space(bpe_tok):
    prompt = bpe_tok.encode("hello").ids
    out = bpe_tok.encode(" world").ids
    detok, deltas, tail = _stream(bpe_tok, prompt, out)
    assert detok.text == " world"
    assert deltas[0].startswith(" ")


def test_decode_window_stays_small(bpe_tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return bpe_tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(TEXTS) * 20
    ids = bpe_tok.encode(text).ids
    assert len(ids) > 500
    detok = IncrementalDetokenizer(Counting(), bpe_tok.encode("prompt text here").ids, SamplingParams())
    for t in ids:
        detok.add(t)
    detok.flush()
    assert detok.text == text
    # At most two decodes per token, each of a window a few tokens wide, not the whole output.
    assert len(calls) <= 2 * len(ids) + 2
    assert max(calls) <= 12


def test_special_tokens_skipped_or_rendered(bpe_tok):
    eos = bpe_tok.token_to_id("<|eos|>")
    ids = bpe_tok.encode("hi 🎉").ids
    seq = ids[:1] + [eos] + ids[1:] + [eos]
    detok, deltas, tail = _stream(bpe_tok, [], seq, SamplingParams(skip_special_tokens=True))
    assert detok.text == "hi 🎉"
    assert deltas[1] == "" and deltas[-1] == ""
    detok, deltas, tail = _stream(bpe_tok, [], seq, SamplingParams(skip_special_tokens=False))
    assert detok.text == bpe_tok.decode(ids[:1]) + "<|eos|>" + bpe_tok.decode(ids[1:]) + "<|eos|>"
    assert deltas[-1] == "<|eos|>"


# ---- stop strings -------------------------------------------------------------------


def _check_stream_never_retracts(deltas, final_text):
    acc = ""
    for d in deltas:
        acc += d
        assert final_text.startswith(acc), (acc, final_text)


def test_stop_string_split_across_tokens_is_cut_and_never_leaked(byte_tok):
    ids = byte_tok.encode("Hello world and more").ids  # one token per byte
    params = SamplingParams(stop=["world"])
    detok = IncrementalDetokenizer(byte_tok, [], params)
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        assert not any(part in "".join(deltas) for part in ["w", "wo", "wor", "worl"])
        if detok.stopped_by:
            break
    assert detok.stopped_by == "world"
    assert detok.text == "Hello "
    assert "".join(deltas) == "Hello "
    assert len(deltas) == len("Hello world")  # stopped on the token that completed it
    assert detok.add(byte_tok.encode("x").ids[0]) == ""
    assert detok.flush() == ""
    assert detok.text == "Hello "


def test_include_stop_str_in_output(byte_tok):
    ids = byte_tok.encode("Hello world and more").ids
    detok, deltas, tail = _stream(byte_tok, [], ids, SamplingParams(stop=["world"], include_stop_str_in_output=True))
    assert detok.stopped_by == "world"
    assert detok.text == "Hello world"
    assert "".join(deltas) + tail == "Hello world"


def test_false_start_of_stop_string_is_released(byte_tok):
    ids = byte_tok.encode("Hello world").ids
    params = SamplingParams(stop=["worm"])
    detok = IncrementalDetokenizer(byte_tok, [], params)
    deltas = [detok.add(t) for t in ids]
    # " wor" was held back while it could still become "worm", then released with "l".
    assert "".join(deltas[:9]) == "Hello "
    assert deltas[9] == "worl"
    assert deltas[10] == "d"
    assert detok.flush() == ""
    assert detok.stopped_by is None
    assert detok.text == "Hello world"


def test_held_back_prefix_is_flushed_at_end(byte_tok):
    ids = byte_tok.encode("the end wo").ids
    detok, deltas, tail = _stream(byte_tok, [], ids, SamplingParams(stop=["world"]))
    assert "".join(deltas) == "the end "
    assert tail == "wo"
    assert detok.text == "the end wo"
    assert detok.stopped_by is None


def test_multibyte_stop_string_split_inside_characters(byte_tok):
    ids = byte_tok.encode("abc 日本語 def").ids
    detok, deltas, tail = _stream(byte_tok, [], ids, SamplingParams(stop=["本語"]))
    assert detok.stopped_by == "本語"
    assert detok.text == "abc 日"
    assert "".join(deltas) + tail == "abc 日"
    assert all("\ufffd" not in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(bpe_tok):
    ids = bpe_tok.encode("one two three four").ids
    detok, deltas, tail = _stream(bpe_tok, [], ids, SamplingParams(stop=["four", "two"]))
    assert detok.stopped_by == "two"
    assert detok.text == "one "


def test_overlapping_stop_prefixes(byte_tok):
    # "abab" contains a proper prefix "ab" of stop "abac" twice; the match starts at the second.
    ids = byte_tok.encode("xababacz").ids
    detok, deltas, tail = _stream(byte_tok, [], ids, SamplingParams(stop=["abac"]))
    assert detok.stopped_by == "abac"
    assert detok.text == "xab"
    _check_stream_never_retracts(deltas, "xab")


def test_random_streams_with_stop_strings_match_reference(bpe_tok):
    rng = random.Random(99)
    stops_pool = ["wor", "日本", "🎉", "o w", "e", "zz", "ック", "brown fox"]
    for _ in range(300):
        text = rng.choice(TEXTS) + rng.choice(TEXTS)
        ids = bpe_tok.encode(text).ids
        stops = rng.sample(stops_pool, rng.randrange(1, 3))
        include = rng.random() < 0.5
        detok, deltas, tail = _stream(bpe_tok, [], ids, SamplingParams(stop=stops, include_stop_str_in_output=include))
        # Reference: cut the full text at the earliest stop-string match.
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            pos, _, s = min(hits)
            expected = text[:pos] + (s if include else "")
            assert detok.stopped_by == s
        else:
            expected = text
            assert detok.stopped_by is None
        assert "".join(deltas) + tail == expected == detok.text, (text, stops)
        _check_stream_never_retracts(deltas, expected)


def test_two_stops_completed_by_one_token_earliest_start_wins(byte_tok):
    # "a" is held as a prefix of "ab"; then "b" completes both "b" and "ab" at once.
    ids = byte_tok.encode("abc").ids
    detok, deltas, tail = _stream(byte_tok, [], ids, SamplingParams(stop=["b", "ab"]))
    assert detok.stopped_by == "ab"
    assert detok.text == ""
    assert deltas == ["", ""] + [""]


@pytest.mark.parametrize("active_from,text", [
    (0, "Hell"),                  # active throughout: the "o" of token 5 stops it
    (6, "Hello w"),               # token 5 came before stops count: its "o" is text; token 8's stops
    (9, "Hello world, g"),        # tokens 5 and 8 both before: the "o" of token 15 stops it
])
def test_stop_strings_count_only_once_min_tokens_are_out(byte_tok, active_from, text):
    """Found in review: min_tokens held back only EOS and stop token ids, so a stop string
    ended a request with min_tokens=20 at its second token (vLLM counts stop strings from the
    min_tokens-th token on). One byte a token here."""
    ids = byte_tok.encode("Hello world, good day").ids
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["o"]))
    out = ""
    for i, t in enumerate(ids, 1):
        out += detok.add(t, stops_active=i >= active_from)
        if detok.stopped_by:
            break
    assert detok.stopped_by == "o" and out == detok.text == text


def test_a_stop_string_that_starts_before_min_tokens_and_ends_after_is_found(byte_tok):
    ids = byte_tok.encode("Hello world").ids
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["world"]))
    out = "".join(detok.add(t, stops_active=i >= 9) for i, t in enumerate(ids, 1) if not detok.stopped_by)
    assert detok.stopped_by == "world" and out == "Hello "


def _held_by_definition(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of a stop string, tried every way."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_held_text_is_exactly_the_longest_partial_stop_match(byte_tok):
    """The hold is tracked by a KMP match per stop string (trying every length each token cost
    O(len(stop)^2) a token, found in review: 10 ms a token with long stops the output kept
    half-matching). Self-overlapping stops over a three-letter alphabet, before and after
    min_tokens, against the definition at every token."""
    rng = random.Random(7)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 7))) + rng.choice(["", "c"])
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("aaabbc") for _ in range(40))
        active_from = rng.choice([0, 20, 40])   # whole matches before min_tokens go on from their border
        detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=stops))
        for i, t in enumerate(byte_tok.encode(text).ids):
            detok.add(t, stops_active=i >= active_from)
            if detok.stopped_by is not None:
                break
            seen = text[:i + 1]
            assert detok.text + detok._pending == seen
            assert len(detok._pending) == _held_by_definition(seen, stops), (stops, seen)
