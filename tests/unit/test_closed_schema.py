"""Objects a schema leaves open are closed before compiling (engine/closed_schema.py): only
where that narrows, never where it could widen or empty what the client's schema allows; and
the grammar the engine compiles holds the closed form."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pydantic
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
    # found in review: a branch beside a $ref meets it; closing both refused {"a": 1, "b": 1}
    {"$ref": "#/$defs/A", "anyOf": [{"properties": {"b": {}}}],
     "$defs": {"A": {"properties": {"a": {}}, "required": ["a"]}}},
    {"allOf": [{"properties": {"a": {}}}], "anyOf": [{"properties": {"b": {}}}]},
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
    {"$ref": "#/$defs/A", "anyOf": [{"properties": {"b": {}}}],
     "$defs": {"A": {"properties": {"a": {}}, "required": ["a"]}}},
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


# A pydantic discriminated union: `oneOf` of $refs, each member requiring `kind` pinned to its
# own const. No instance matches two members, so closing them cannot widen (closed_schema's
# _discriminated); left open, the model wrote extra keys in the member until max_tokens.
class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    meows: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    barks: float


class Owner(pydantic.BaseModel):
    name: str
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]


def test_discriminated_union_members_are_closed():
    schema = Owner.model_json_schema()
    assert schema["properties"]["pet"]["oneOf"] == [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]
    s = closed(schema)
    assert s["additionalProperties"] is False
    assert s["$defs"]["Cat"]["additionalProperties"] is False
    assert s["$defs"]["Dog"]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["pet"]   # the union itself has no properties


def test_discriminated_union_inline_members_enum_tags_and_nesting_are_closed():
    """Members written inline, tags as an enum of one value (older pydantic) or a number, a
    union inside a union's member and an array of unions."""
    inner = {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}, "x": {}}, "required": ["t"]},
                       {"type": "object", "properties": {"t": {"const": 2}, "y": {}}, "required": ["t"]}]}
    s = closed({"type": "array", "items": {"oneOf": [
        {"type": "object", "properties": {"k": {"enum": ["a"]}, "in": inner}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": ["b"]}}, "required": ["k"]}]}})
    a, b = s["items"]["oneOf"]
    assert a["additionalProperties"] is False and b["additionalProperties"] is False
    assert all(m["additionalProperties"] is False for m in a["properties"]["in"]["oneOf"])


def _pair(cat: dict, dog: dict, **beside) -> dict:
    return {"type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                                     **beside}},
            "required": ["pet"], "additionalProperties": False, "$defs": {"Cat": cat, "Dog": dog}}


CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "meows": {}}, "required": ["kind"]}
DOG = {"type": "object", "properties": {"kind": {"const": "dog"}, "barks": {}}, "required": ["kind"]}


class LazyDog(pydantic.BaseModel):
    kind: Literal["dog"] = "dog"   # a default takes `kind` out of `required`
    barks: float


class LazyOwner(pydantic.BaseModel):
    pet: Annotated[Cat | LazyDog, pydantic.Field(discriminator="kind")]


@pytest.mark.parametrize("schema", [
    _pair({k: v for k, v in CAT.items() if k != "type"}, DOG),               # no type: a string matches both
    _pair({"type": "string"}, DOG),                                          # a member that is no object
    _pair({**CAT, "properties": {"meows": {}}}, DOG),                        # a member without the tag
    _pair({**CAT, "required": []}, DOG),                                     # the tag not required
    LazyOwner.model_json_schema(),                                          # ... as pydantic writes a default
    _pair(CAT, {**DOG, "properties": {"kind": {"const": "cat"}, "barks": {}}}),   # the same tag twice
    _pair({**CAT, "properties": {"kind": {"const": 1}}}, {**DOG, "properties": {"kind": {"const": 1.0}}}),  # 1 == 1.0
    _pair({**CAT, "properties": {"kind": {"enum": ["cat", "dog"]}}}, DOG),   # an enum of two pins nothing
    _pair({**CAT, "properties": {"kind": {"$ref": "#/$defs/Tag"}}}, DOG),    # a tag it cannot see
    _pair(CAT, DOG, properties={"name": {}}),                                # closed members would refuse name
    _pair(CAT, DOG, anyOf=[{"properties": {"name": {}}}]),                   # ... or an anyOf's keys
    {"oneOf": [{"$ref": "#/$defs/Pets"}, {"type": "string"}], "$defs": {"Pets": _pair(CAT, DOG)["properties"]["pet"],
                                                                       "Cat": CAT, "Dog": DOG}},  # under a real oneOf
])
def test_unions_that_are_not_clearly_discriminated_stay_open(schema):
    assert closed(schema)["$defs"] == schema["$defs"]


def test_a_member_also_used_where_closing_is_unsafe_stays_open():
    """Cat is the union's member and is also under `not`: it stays open there and so here
    (an open member of a discriminated union is still sound); Dog is closed."""
    schema = _pair(CAT, DOG)
    schema["properties"]["notcat"] = {"not": {"$ref": "#/$defs/Cat"}}
    s = closed(schema)
    assert s["$defs"]["Cat"] == CAT
    assert s["$defs"]["Dog"]["additionalProperties"] is False


class Leaf(pydantic.BaseModel):
    kind: Literal["leaf"]
    value: int


class Node(pydantic.BaseModel):
    kind: Literal["node"]
    children: list[Annotated[Leaf | Node, pydantic.Field(discriminator="kind")]]


class Tree(pydantic.BaseModel):
    root: Annotated[Leaf | Node, pydantic.Field(discriminator="kind")]


def test_a_recursive_union_is_closed_unless_used_where_closing_is_unsafe():
    """Node holds a union of Leaf and Node. Under `not`, Node is guarded, and so is Leaf, which
    is reached only through the union inside Node: a discriminated union does not end a guard."""
    s = closed(Tree.model_json_schema())
    assert s["$defs"]["Leaf"]["additionalProperties"] is False
    assert s["$defs"]["Node"]["additionalProperties"] is False
    schema = Tree.model_json_schema()
    schema["properties"]["root"] = {"not": {"$ref": "#/$defs/Node"}}
    assert closed(schema)["$defs"] == schema["$defs"]


def test_closing_a_discriminated_union_keeps_what_it_allowed_and_refuses_extra_keys():
    schema = Owner.model_json_schema()
    tight = jsonschema.Draft202012Validator(closed(schema))
    loose = jsonschema.Draft202012Validator(schema)
    for pet in ({"kind": "cat", "meows": 3}, {"kind": "dog", "barks": 1.5}):
        assert loose.is_valid({"name": "Ann", "pet": pet}) and tight.is_valid({"name": "Ann", "pet": pet})
    for pet in ({"kind": "cat", "meows": 3, "color": "red"}, {"kind": "dog", "barks": 1.5, "meows": 2}):
        assert loose.is_valid({"name": "Ann", "pet": pet}) and not tight.is_valid({"name": "Ann", "pet": pet})
    for pet in ({"kind": "cow", "meows": 3}, {"kind": "dog", "meows": 3}, {"meows": 3}):
        assert not loose.is_valid({"name": "Ann", "pet": pet}) and not tight.is_valid({"name": "Ann", "pet": pet})


def test_the_compiled_grammar_holds_a_closed_union_member():
    """Inside either member, after its last declared key, '}' is allowed and ',' refused: the
    model cannot go on writing keys there (what the probe saw until max_tokens)."""
    tok = load_router_tokenizer(None)
    llt = ll_tokenizer(tok)
    schema = json.dumps(Owner.model_json_schema())
    assert check_schema(llt, schema) is None
    comma, brace = tok.encode(",", add_special=False), tok.encode("}", add_special=False)
    for text in ('{"name":"Ann","pet":{"kind":"cat","meows":3', '{"name":"Ann","pet":{"kind":"dog","barks":1.5'):
        ends, goes_on = GrammarCache(llt).constraint("alice", schema), GrammarCache(llt).constraint("alice", schema)
        for t in tok.encode(text, add_special=False):
            ends.consume(t)
            goes_on.consume(t)
        assert ends.consume(brace[0]) is False   # allowed, and the answer goes on: '}' closes only pet
        with pytest.raises(GrammarFailed):
            goes_on.consume(comma[0])
