"""Structured output's parts without the model: the compile cache is keyed on the cache scope
(a tenant never reuses another tenant's compiled grammar), it stays bounded, the masks mean
what llguidance says, and the schema crosses the PD wire."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvfence.engine.grammar import GrammarCache, GrammarError, GrammarFailed, check_schema, ll_tokenizer, mask_bias
from kvfence.engine.logits_processors import History, adjust
from kvfence.engine.params import MAX_JSON_SCHEMA_BYTES, SamplingParams
from kvfence.pd.messages import MessageError, WireParams
from kvfence.pd.router import load_router_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return load_router_tokenizer(None)     # the bundled model's tokenizer, no weights


@pytest.fixture(scope="module")
def llt(tok):
    return ll_tokenizer(tok)


def fill_masks(rows, width: int) -> np.ndarray:
    """bool [rows, width]: what the bias allows (0.0) and forbids (-inf), nothing else."""
    bias = mask_bias(rows, width)
    assert bool(((bias == 0) | torch.isneginf(bias)).all())
    return (bias == 0).numpy()


def _schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})


def test_a_tenant_never_reuses_another_tenants_compiled_grammar(llt):
    cache = GrammarCache(llt)
    s = json.dumps(PERSON)
    cache.constraint("alice", s)
    cache.constraint("alice", s)
    assert (cache.hits, cache.misses) == (1, 1)          # reused within alice's scope
    cache.constraint("bob", s)
    # without the scope in the key bob would hit alice's entry (and could time it)
    assert (cache.hits, cache.misses) == (1, 2)
    assert len(cache) == 2
    cache.constraint("\0public:docs", s)                 # a public scope is a scope of its own too
    assert cache.misses == 3


def test_the_cache_is_bounded_per_scope_and_overall(llt):
    cache = GrammarCache(llt, per_scope=2, total=3)
    for i in range(3):
        cache.constraint("alice", _schema(i))
    assert len(cache) == 2                               # alice's oldest went
    cache.constraint("alice", _schema(2))
    assert cache.hits == 1
    cache.constraint("alice", _schema(0))
    assert cache.hits == 1                               # evicted: compiled again
    cache.constraint("bob", _schema(0))
    cache.constraint("carol", _schema(0))
    assert len(cache) == 3                               # the global cap
    # a busy scope evicts its own entries, not another tenant's
    before = cache.misses
    cache.constraint("carol", _schema(0))
    assert cache.misses == before


def test_copies_start_at_the_grammars_beginning(llt, tok):
    cache = GrammarCache(llt)
    s = json.dumps(PERSON)
    a = cache.constraint("alice", s)
    for t in tok.encode('{"name":"Al', add_special=False):
        assert not a.consume(t)
    b = cache.constraint("alice", s)                     # a hit: a fresh copy, not a's position
    first = fill_masks([b], llt.vocab_size)[0]
    assert tok.decode([int(np.flatnonzero(first)[0])]).startswith("{")


def test_masks_match_llguidance_and_hold_back_the_end_until_the_grammar_accepts(llt, tok):
    c = GrammarCache(llt).constraint("alice", json.dumps(PERSON))
    width = llt.vocab_size + 7                            # a logits row wider than the vocabulary
    mask = fill_masks([c], width)[0]
    bias = np.frombuffer(c.matcher.compute_logit_bias(), dtype=np.uint8)[:llt.vocab_size] > 0
    assert np.array_equal(mask[:llt.vocab_size], bias)   # the bit unpacking reads llguidance's own mask
    assert not mask[llt.vocab_size:].any()
    assert not any(mask[e] for e in tok.end_ids)         # no end before the JSON is complete
    done = False
    for t in tok.encode('{"name":"Al"}', add_special=False):
        done = c.consume(t)
    assert done or all(fill_masks([c], width)[0][e] for e in tok.end_ids)


def test_adjust_bans_what_the_grammar_forbids_and_leaves_other_rows(llt, tok):
    c = GrammarCache(llt).constraint("alice", json.dumps(PERSON))
    logits = torch.randn(2, llt.vocab_size)
    p = SamplingParams(temperature=0, json_schema=PERSON)
    out = adjust(logits, [p, SamplingParams()], [History([], [], frozenset(), c), History([], [], frozenset())])
    allowed = torch.from_numpy(fill_masks([c], llt.vocab_size)[0].copy())
    assert torch.isinf(out[0][~allowed]).all() and torch.equal(out[0][allowed], logits[0][allowed])
    assert torch.equal(out[1], logits[1])


def test_a_refused_token_or_a_broken_matcher_is_a_grammar_failure(llt, tok):
    c = GrammarCache(llt).constraint("alice", json.dumps(PERSON))
    with pytest.raises(GrammarFailed):
        c.consume(tok.encode("hello", add_special=False)[0])
    with pytest.raises(GrammarFailed):
        fill_masks([c], llt.vocab_size)                  # the matcher stays in error


def test_unsupported_and_oversized_schemas_are_named(llt):
    assert "dependentSchemas" in check_schema(llt, json.dumps({"type": "object", "dependentSchemas": {"a": {}}}))
    assert "look-around" in check_schema(llt, json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    assert check_schema(llt, json.dumps(PERSON)) is None
    with pytest.raises(GrammarError, match="dependentSchemas"):
        GrammarCache(llt).constraint("alice", json.dumps({"type": "object", "dependentSchemas": {"a": {}}}))
    with pytest.raises(ValueError, match="larger than"):
        SamplingParams(json_schema={"enum": ["x" * MAX_JSON_SCHEMA_BYTES]})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams(json_schema="[1, 2]")


def test_the_schema_crosses_the_pd_wire(tok):
    p = SamplingParams(temperature=0, max_tokens=32, json_schema=PERSON)
    back = WireParams.from_json(WireParams.of(p).dumps()).to_params()
    assert back == p and back.json_schema == json.dumps(PERSON, separators=(",", ":"))
    assert WireParams.from_json(WireParams.of(SamplingParams()).dumps()).to_params().json_schema is None
    with pytest.raises(MessageError, match="json_schema"):
        WireParams.from_json({"json_schema": "{" + " " * (64 << 10) + "}"})


def test_the_mask_kernel_writes_what_the_bias_path_adds():
    from kvfence.engine.grammar import _BYTE_BIAS
    from kvfence.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels on this machine")
    rng = np.random.default_rng(0)
    words, cols = 5, 5 * 32 + 9                           # logits wider than the mask
    mask = rng.integers(-2**31, 2**31 - 1, size=(3, words), dtype=np.int32)
    mask[0, 1] = -1                                       # a word of allowed tokens (skipped)
    mask[1, :] = 0
    mask[1, 2] = -(1 << 31)                               # only the last token of a word
    x = torch.randn(4, cols)
    rows = torch.tensor([3, 0, 2])
    got = x.clone()
    kernels.apply_token_mask(got, rows, mask)
    bias = torch.nn.functional.embedding(torch.from_numpy(mask.view(np.uint8).astype(np.int64)).view(-1),
                                         _BYTE_BIAS).view(3, -1)
    want = x.clone()
    want[rows, :words * 32] += bias
    want[rows, words * 32:] = float("-inf")
    assert torch.equal(got, want)
    assert torch.equal(got[1], x[1])                      # a row not named is untouched
    with pytest.raises(ValueError, match="row index"):
        kernels.apply_token_mask(x, torch.tensor([0, 4, 1]), mask)
