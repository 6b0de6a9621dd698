"""Structured outputs: a JSON schema as a token-by-token constraint, with llguidance.

llguidance (not xgrammar) because it runs on the CPU next to the sampler, compiles a JSON
schema lazily (a matcher for a small schema is ready in under a millisecond; the lexer's
states are built as generation reaches them) and works on the tokenizer's own byte-level
tokens, so a token that straddles JSON syntax is allowed exactly when its bytes are.

- `ll_tokenizer`: one llguidance tokenizer per kvfence tokenizer (a quarter of a second to build).
- objects the schema does not say are open are closed first (engine/closed_schema.py).
- `check_schema`: why a schema cannot be compiled (the server's 400), or None; its cost has no
  bound, so the server runs it in schema_check.py's worker, under a deadline.
- `build_matcher`: a schema's matcher, built by the server off the engine thread.
- `GrammarCache`: compiled matchers, keyed on (cache scope, schema digest) and reused only
  within that scope (I9's rule for the prefix cache, applied here): copies of one matcher
  share its lazily built lexer states, so a cache shared across tenants would let one tenant
  time whether another tenant used a schema.
- `fill_masks`: the allowed-token masks of all grammar rows of a step in one parallel call.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvfence.engine.closed_schema import close_objects
from kvfence.engine.params import MAX_JSON_SCHEMA_BYTES

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from kvfence.model.tokenizer import KvTokenizer

# compact JSON, no whitespace between tokens: a small model given the choice emits newlines
# and spaces until max_tokens (llguidance's default allows any whitespace)
_COMPILE_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# and whatever a schema's own x-guidance says (schema_leniency drops a client's; this holds if
# one gets through): compact JSON with JSON's separators; a client's options turned "x = y" into
# an accepted answer
_OVERRIDES: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
                                  "whitespace_pattern": None, "coerce_one_of": False, "lenient": False}


class GrammarError(ValueError):
    """A schema that llguidance cannot compile (the client's 400, param response_format)."""


class GrammarFailed(RuntimeError):
    """A matcher refused a token or failed while computing a mask: that request ends alone."""


class GrammarLimit(GrammarFailed):
    """The matcher failed while computing the next mask, or its mask allows nothing: the
    client's schema took llguidance past one of its limits (a large multipleOf with a large
    maximum builds too many lexer expressions) or into a dead end. A refused token, by contrast,
    means a mask was not applied: our fault, not the schema's."""


def _past_limits(why: str) -> GrammarLimit:
    why = why.replace("<non-verbose/>", "").strip()   # llguidance's marker, not part of its message
    return GrammarLimit(f"the schema took the grammar engine past its limits while generating ({why}); a simpler "
                        "one (a smaller multipleOf, maximum or pattern) avoids it")


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer_args(tok: KvTokenizer, n_vocab: int | None = None) -> tuple[str, int, list[int]]:
    """What llguidance's tokenizer is built from: the tokenizer's JSON, the vocabulary width
    (the model's logits width when wider) and the end-of-generation ids (its EOS). Here and in
    schema_check.py's worker, which builds its own from them."""
    return tok.hf.to_str(), max(tok.vocab_size, n_vocab or 0), sorted(tok.end_ids)


def ll_tokenizer(tok: KvTokenizer, n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of `tok` (built once per tokenizer; the server validates with the same
    one the engine constrains with). End-of-generation ids are its EOS: allowed only once the
    grammar accepts. `n_vocab`: the model's logits width, when wider than the tokenizer."""
    import llguidance

    with _lock:
        got = _tokenizers.get(tok)
        if got is None:
            text, n, eos = ll_tokenizer_args(tok, n_vocab)
            got = llguidance.LLTokenizer(text, n_vocab=n, eos_token=eos)
            _tokenizers[tok] = got
        return got


def schema_digest(schema_json: str) -> str:
    return hashlib.sha256(schema_json.encode()).hexdigest()


def grammar_for(schema_json: str) -> str:
    """llguidance's grammar text for a schema (cheap: nothing is compiled yet); GrammarError if
    the schema is too large or not one llguidance takes."""
    import llguidance

    if len(schema_json.encode()) > MAX_JSON_SCHEMA_BYTES:
        raise GrammarError(f"the schema is larger than {MAX_JSON_SCHEMA_BYTES} bytes of JSON")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema_json), defaults=_COMPILE_OPTIONS,
                                                             overrides=_OVERRIDES)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def check_schema(tok: llguidance.LLTokenizer, schema_json: str) -> str | None:
    """llguidance's own message for a schema it cannot compile (an unsupported keyword, a bad
    $ref, a regex with look-around, ...), or None. Compiles from scratch: no cache to time.
    Its cost has no bound: the server runs it in schema_check.py's worker, under a deadline."""
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(grammar_for(schema_json), tok)
    except ValueError as e:   # GrammarError included
        return str(e)
    return err or None


def build_matcher(tok: llguidance.LLTokenizer, schema_json: str) -> llguidance.LLMatcher:
    """A matcher at the grammar's start: what GrammarCache keeps and copies. Its cost has no bound
    of its own (schema_check.py's deadline is the bound): the server builds it in a thread and
    hands it to the engine (`built`), whose thread must not spend seconds on it."""
    import llguidance

    try:
        grammar = grammar_for(schema_json)
    except GrammarError as e:
        raise GrammarError(f"the schema cannot be compiled: {e}") from None
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        raise GrammarError(f"the schema cannot be compiled: {matcher.get_error()}")
    return matcher


def _limits():
    import llguidance

    # errors raised mid-generation are logged: they must not carry the generated text
    return llguidance.LLParserLimits(verbose_errors=False)


class GrammarCache:
    """Compiled matchers to copy, LRU-bounded per cache scope and overall. The key includes the
    scope, so a tenant never reuses (or times) another tenant's compiled grammar."""

    def __init__(self, tok: llguidance.LLTokenizer, per_scope: int = 64, total: int = 1024):
        self.tok, self.per_scope, self.total = tok, per_scope, total
        self._lru: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._per: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.built = 0   # requests that brought their own matcher (the server's, each built for it)

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._lru), "scopes": len(self._per), "hits": self.hits, "misses": self.misses,
                "built": self.built}

    def constraint(self, scope: str, schema_json: str, built: llguidance.LLMatcher | None = None) -> Constraint:
        """A fresh matcher (at the grammar's start) for one request in `scope`; GrammarError
        if the schema does not compile. `built`: build_matcher's for this request, made off the
        engine thread: it is the request's own, and the cache is not used. llguidance's copies of
        one matcher share its lexer's budget: once one request spends it ("too many expressions
        constructed") every copy fails, those running and those to come, so a cached matcher
        would let one request (or a public scope's member) fail another's (found in review)."""
        if built is not None:   # a copy each: one request's n choices share only their own budget
            self.built += 1
            return Constraint(built.deep_copy(), self.tok.vocab_size)
        key = (scope, schema_digest(schema_json))
        base = self._lru.get(key)
        if base is not None:
            self.hits += 1
            self._lru.move_to_end(key)
            return Constraint(base.deep_copy(), self.tok.vocab_size, cache_key=key)
        self.misses += 1
        base = build_matcher(self.tok, schema_json)
        self._lru[key] = base
        self._per[scope] = self._per.get(scope, 0) + 1
        if self._per[scope] > self.per_scope:
            self._evict(next(k for k in self._lru if k[0] == scope))
        while len(self._lru) > self.total:
            self._evict(next(iter(self._lru)))
        return Constraint(base.deep_copy(), self.tok.vocab_size, cache_key=key)

    def forget(self, key: tuple[str, str]) -> None:
        """A copy of this entry spent the budget its copies share (GrammarLimit): the next
        request builds anew rather than fail at once."""
        if key in self._lru:
            self._evict(key)

    def _evict(self, key: tuple[str, str]) -> None:
        del self._lru[key]
        self._per[key[0]] -= 1
        if not self._per[key[0]]:
            del self._per[key[0]]


@dataclass
class Constraint:
    """One request's grammar: its matcher, and the width of llguidance's masks for it."""
    matcher: llguidance.LLMatcher
    vocab: int
    # the mask fill_bitmask computed for the next token (int32 words), until it is consumed
    allowed: np.ndarray | None = field(default=None, repr=False)
    limit: GrammarLimit | None = None   # the mask that failed: the same error when its row is asked alone
    cache_key: tuple[str, str] | None = None   # the GrammarCache entry it copies, if any

    def consume(self, token: int) -> bool:
        """Advance by the sampled token; True when the grammar is done (the request stops).
        GrammarLimit if the matcher fails on a token its own mask allowed (the schema's limits),
        GrammarFailed if it refuses one no mask allowed (the server's fault)."""
        mask, self.allowed = self.allowed, None   # each mask is for one token
        ok = self.matcher.consume_token(token)
        if ok and not self.matcher.is_error():
            return self.matcher.is_stopped()
        why = self.matcher.get_error()
        if ok or (mask is not None and (int(mask[token >> 5]) >> (token & 31)) & 1):
            raise _past_limits(why)
        raise GrammarFailed(f"the output grammar refused token {token}: {why}")


_executor: llguidance.LLExecutor | None = None
# byte -> the 8 tokens it covers as additive logits: 0.0 allowed, -inf forbidden (bit k of a
# mask byte is its k-th token: llguidance's words are little-endian 32-bit)
_BYTE_BIAS = torch.from_numpy(np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(0.0), np.float32(-np.inf)))


def fill_bitmask(rows: list[Constraint]) -> np.ndarray:
    """int32 [len(rows), words]: llguidance's allowed-token bits for each row, all rows in one
    call. GrammarFailed if a matcher was in error before; GrammarLimit if computing its mask
    failed or it allows nothing (the sampler then samples each row alone, so only that request
    fails)."""
    global _executor
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    if _executor is None:
        # as many threads as the model's: they run between forward passes, when those are idle
        # (llguidance's default, 80% of the CPUs, is one thread on a 2-core machine)
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    vocab = rows[0].vocab
    if any(r.vocab != vocab for r in rows):
        raise ValueError("grammar rows of one batch must share a tokenizer")
    for r in rows:
        if r.limit is not None:   # its mask failed in the batch: the sampler asks for its row alone
            raise r.limit
        if r.matcher.is_error():   # in error before this mask: not the schema's limits
            raise GrammarFailed(f"the output grammar failed: {r.matcher.get_error()}")
    bitmask = allocate_token_bitmask(len(rows), vocab)
    fill_next_token_bitmask_par(_executor, [(r.matcher, i) for i, r in enumerate(rows)], bitmask)
    for i, r in enumerate(rows):
        if r.matcher.is_error():
            r.limit = _past_limits(r.matcher.get_error())
        elif not bitmask[i].any():
            r.limit = GrammarLimit("the schema's grammar allows no next token")
        r.allowed = bitmask[i]
    for r in rows:
        if r.limit is not None:
            raise r.limit
    return bitmask


def mask_bias(rows: list[Constraint], width: int) -> torch.Tensor:
    """float32 [len(rows), width] to add to the rows' logits: 0.0 where the grammar allows the
    token next, -inf elsewhere (and past the tokenizer's vocabulary). A table lookup per mask
    byte: building it from a bool mask (unpackbits, masked_fill) cost ~8 ms at batch 32 and
    49k tokens, the lookup and an add ~1 ms."""
    bitmask = fill_bitmask(rows)
    idx = torch.from_numpy(bitmask.view(np.uint8).astype(np.int64)).view(-1)
    bias = torch.nn.functional.embedding(idx, _BYTE_BIAS).view(len(rows), -1)
    if width <= bias.shape[1]:
        return bias[:, :width]
    return torch.nn.functional.pad(bias, (0, width - bias.shape[1]), value=float("-inf"))
