"""A schema that is not strict loses only what the grammar cannot hold and JSON Schema lets
go: uniqueItems and a format llguidance does not know. Everything else it cannot hold is still
refused (llguidance's own lenient mode dropped not, if/then/else and oneOf's exclusivity too,
found in review), a strict schema keeps everything, and a client's x-guidance never reaches the
compiler's options."""
from __future__ import annotations

import json

import llguidance
import pytest

from kvfence.engine.grammar import check_schema, grammar_for, ll_tokenizer
from kvfence.engine.schema_leniency import held_as
from kvfence.pd.router import load_router_tokenizer

SET_AND_SECRET = {"type": "object", "required": ["uniqueItems"], "x-guidance": {"lenient": True},
                  "properties": {"uniqueItems": {"type": "array", "uniqueItems": True,    # a property so named
                                                 "items": {"type": "string", "format": "password"}},
                                 "mail": {"type": "string", "format": "email"},
                                 "tag": {"const": {"format": "binary", "uniqueItems": True}}},
                  "$defs": {"D": {"type": "string", "format": "ipvanyaddress"}}}


@pytest.fixture(scope="module")
def tok():
    return ll_tokenizer(load_router_tokenizer(None))


def test_not_strict_drops_only_unique_items_and_unknown_formats():
    held = held_as(SET_AND_SECRET, strict=False)
    assert held == {"type": "object", "required": ["uniqueItems"],
                    "properties": {"uniqueItems": {"type": "array", "items": {"type": "string"}},
                                   "mail": {"type": "string", "format": "email"},         # enforced: kept
                                   "tag": {"const": {"format": "binary", "uniqueItems": True}}},   # data
                    "$defs": {"D": {"type": "string"}}}
    assert held_as(SET_AND_SECRET, strict=True) == {k: v for k, v in SET_AND_SECRET.items() if k != "x-guidance"}


def test_what_else_the_grammar_cannot_hold_is_still_refused(tok):
    held = json.dumps(held_as(SET_AND_SECRET, strict=False))
    assert check_schema(tok, held) is None
    assert "uniqueItems" in check_schema(tok, json.dumps(held_as(SET_AND_SECRET, strict=True)))
    for kw in ({"not": {"required": ["a"]}}, {"if": {"required": ["a"]}, "then": {"required": ["b"]}},
               {"dependentSchemas": {"a": {}}}):
        schema = {"type": "object", "properties": {"a": {}, "b": {}}, **kw, "x-guidance": {"lenient": True}}
        assert check_schema(tok, json.dumps(held_as(schema, strict=False))), kw


def test_a_clients_x_guidance_cannot_loosen_the_json(tok):
    # kept by the schema, the compiler's options are still the server's (grammar._OVERRIDES)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}},
                         "x-guidance": {"whitespace_flexible": True, "key_separator": " = "}})
    tk = load_router_tokenizer(None)
    for text, whole in (('{"a":"x"}', True), ('{"a" = "x"}', False), ('{\n"a":"x"}', False)):
        m = llguidance.LLMatcher(tok, grammar_for(schema))
        ids = tk.encode(text)
        assert (m.try_consume_tokens(ids) == len(ids)) is whole, text
