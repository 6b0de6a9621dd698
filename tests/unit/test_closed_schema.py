"""Objects a schema leaves open are closed before compiling (engine/closed_schema.py): only
where that narrows, never where it could widen or empty what the client's schema allows; and
the grammar the engine compiles holds the closed form."""
from __future__ import annotations

import json

import jsonschema
import pytest

from kvfence.engine.closed_schema import close_objects
from kvfence.engine.grammar import GrammarCache, GrammarFailed, check_schema, ll_tokenizer
from kvfence.pd.router import load_router_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def closed(schema: dict) -> dict:
    return json.loads(close_objects(json.dumps(schema)))


def test_open_objects_and_tuples_are_closed_at_every_depth():
    s = closed({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "list": {"type": "array", "items": {"properties": {"c": {}}}},
        "pair": {"prefixItems": [{"type": "integer"}, {"properties": {"d": {}}}]},
        "either": {"anyOf": [{"properties": {"e": {}}}, {"type": "null"}]}},
        "$defs": {"X": {"properties": {"x": {}}}}})
    assert s["additionalProperties"] is False
    p = s["properties"]
    assert p["a"]["additionalProperties"] is False
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["pair"]["items"] is False and p["pair"]["prefixItems"][1]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert s["$defs"]["X"]["additionalProperties"] is False


@pytest.mark.parametrize("schema", [
    {"type": "object"},                                                       # json_object: any keys
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"prefixItems": [{}], "items": {"type": "integer"}},
    {"not": {"properties": {"a": {}}}},                                       # closing would widen
    {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]},           # b comes from the branch
    {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},         # closing both empties it
    {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
     "$defs": {"A": {"properties": {"a": {"$ref": "#/$defs/C"}}}, "B": {"properties": {"b": {}}},
               "C": {"properties": {"c": {}}}}},
    {"$ref": "#/$defs/A", "properties": {"b": {"properties": {"c": {}}}}, "$defs": {"A": {"type": "object"}}},
    # found in review: the inheritance pattern one level down; closing Base emptied "pet"
    {"properties": {"pet": {"allOf": [{"$ref": "#/$defs/Base"}], "properties": {"bark": {"type": "boolean"}},
                            "required": ["bark"]}},
     "required": ["pet"], "additionalProperties": False,
     "$defs": {"Base": {"properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},        # closing would widen
    {"not": {"$ref": "#/$defs/A"}, "$defs": {"A": {"properties": {"a": {}}}}},
    {"properties": {"self": {"not": {"$ref": "#"}}}},                          # the root itself is guarded
    [1, 2],
])
def test_what_is_left_as_the_client_wrote_it(schema):
    assert closed(schema) == schema


def test_text_it_cannot_read_passes_through_for_the_compiler_to_name():
    deep = '{"items":' * 5000 + "{}" + "}" * 5000
    assert close_objects(deep) == deep
    assert close_objects("{not json") == "{not json"


INSTANCES = [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": {"c": 1}}, {"a": {"c": 1, "z": 2}}, {"x": 1},
             {"a": 1, "b": 2, "c": 3}, [1], [1, 2], [1, {"d": 1}], [1, {"d": 1, "z": 0}],
             {"a": 1, "x": {"x": 1}}, "s", 1, None]
NARROWING_CASES = [
    {"properties": {"a": {"properties": {"c": {}}}}},
    {"properties": {"a": {"allOf": [{"$ref": "#/$defs/B"}], "properties": {"z": {}}}},
     "$defs": {"B": {"properties": {"c": {}}}}},
    {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    {"not": {"$ref": "#/$defs/A"}, "$defs": {"A": {"properties": {"a": {}}}}},
    {"not": {"properties": {"a": {}}}},
    {"not": {"properties": {"a": {}}, "required": ["a"]}},
    {"anyOf": [{"properties": {"a": {}}}, {"not": {"properties": {"b": {}}, "required": ["b"]}}]},
    {"if": {"properties": {"a": {}}, "required": ["a"]}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    {"prefixItems": [{}, {"properties": {"d": {}}}]},
    {"oneOf": [{"properties": {"a": {}}, "required": ["a"]}, {"properties": {"b": {}}, "required": ["b"]}]},
    {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "required": ["a", "b"]},
]


@pytest.mark.parametrize("schema", NARROWING_CASES)
def test_closing_only_narrows(schema):
    """Whatever the closed schema accepts, the client's accepts too: on these instances, and
    on the not/if cases the skip list exists for (closing under `not` would accept {"b": 1})."""
    tight = closed(schema)
    for x in INSTANCES:
        if jsonschema.Draft202012Validator(tight).is_valid(x):
            assert jsonschema.Draft202012Validator(schema).is_valid(x), (tight, x)


def test_the_compiled_grammar_holds_the_closed_form():
    """After `{"city":"Paris"` the grammar allows the object to end and nothing else: the model
    cannot add keys the schema never named (without closing, ',' would be allowed)."""
    tok = load_router_tokenizer(None)
    llt = ll_tokenizer(tok)
    assert check_schema(llt, json.dumps(CITY)) is None
    c = GrammarCache(llt).constraint("alice", json.dumps(CITY))
    for t in tok.encode('{"city":"Paris"', add_special=False):
        c.consume(t)
    comma, brace = tok.encode(",", add_special=False), tok.encode("}", add_special=False)
    assert len(comma) == len(brace) == 1
    c2 = GrammarCache(llt).constraint("alice", json.dumps(CITY))
    for t in tok.encode('{"city":"Paris"', add_special=False):
        c2.consume(t)
    assert c.consume(brace[0])                       # done: the grammar accepts and stops
    with pytest.raises(GrammarFailed):
        c2.consume(comma[0])
