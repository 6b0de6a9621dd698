"""Combined schemas (a call's arguments, an answer's format, kvfence/server/schema_parts.py)
compiled by llguidance with the bundled tokenizer: what each part allows alone, the combined
grammar allows in its place (found in review: nested definitions escaped closed_schema's
guards, and a property named like a keyword stopped the ref rewriting)."""
from __future__ import annotations

import json

import llguidance
import pytest

from kvfence.engine.grammar import check_schema, grammar_for, ll_tokenizer
from kvfence.engine.params import canonical_schema
from kvfence.pd.router import load_router_tokenizer
from kvfence.server.schema_parts import SchemaParts
from kvfence.server.tools import ToolSpec, call_or_answer_schema, call_schema

# pydantic's nested-model form, with a field named like a keyword ("examples", "default")
NESTED = {"type": "object", "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                "required": ["n"]}},
          "properties": {"examples": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2},
                         "default": {"$ref": "#/$defs/Item"}},
          "required": ["examples", "default"]}
# the inheritance pattern closed_schema must leave open: Base closed would refuse "b"
INHERITS = {"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
            "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"b": {"type": "string"}}, "required": ["a", "b"]}
# a tree: refs to the root
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                          "maxItems": 2}},
        "required": ["v", "kids"]}
TOOL = {"name": "f", "description": "", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                        "required": ["x"]}}


@pytest.fixture(scope="module")
def tok():
    return load_router_tokenizer(None)


def accepts(tok, schema: dict, text: str) -> bool:
    llt = ll_tokenizer(tok)
    text_schema = canonical_schema(schema)
    assert check_schema(llt, text_schema) is None
    m = llguidance.LLMatcher(llt, grammar_for(text_schema))
    return m.consume_tokens(tok.encode(text, add_special=False)) and m.is_accepting()


@pytest.mark.parametrize("answer,good,bad", [
    (NESTED, '{"examples":[{"n":1}],"default":{"n":2}}', '{"examples":[{"n":"x"}],"default":{"n":2}}'),
    (INHERITS, '{"a":1,"b":"x"}', '{"a":"1","b":"x"}'),
    (TREE, '{"v":1,"kids":[{"v":2,"kids":[]}]}', '{"v":1,"kids":[{"v":2}]}'),
])
def test_an_answer_beside_a_call_allows_what_it_allows_alone(tok, answer, good, bad):
    spec = ToolSpec([TOOL], "auto")
    both = call_or_answer_schema(spec, canonical_schema(answer))
    assert accepts(tok, answer, good) and not accepts(tok, answer, bad)
    assert accepts(tok, both, good) and not accepts(tok, both, bad)
    assert accepts(tok, both, '{"name":"f","arguments":{"x":3}}')
    assert not accepts(tok, both, '{"name":"f","arguments":{"x":"3"}}')


@pytest.mark.parametrize("params", [NESTED, INHERITS, TREE])
def test_tool_parameters_keep_their_meaning_in_the_call_schema(tok, params):
    spec = ToolSpec([TOOL, {**TOOL, "name": "g", "parameters": params}], "required", parallel=True)
    args = {id(NESTED): '{"examples":[],"default":{"n":1}}', id(INHERITS): '{"a":1,"b":"x"}',
            id(TREE): '{"v":1,"kids":[]}'}[id(params)]
    assert accepts(tok, call_schema(spec), f'[{{"name":"f","arguments":{{"x":1}}}},{{"name":"g","arguments":{args}}}]')


def test_definitions_move_to_the_root_under_the_parts_prefix():
    parts = SchemaParts()
    body = parts.add({"$schema": "x", "definitions": {"A/b": {"const": {"$ref": "#"}}},
                      "properties": {"const": {"$ref": "#/definitions/A~1b"}, "self": {"$ref": "#/properties/const"}}},
                     "p")
    assert body == {"properties": {"const": {"$ref": "#/$defs/p:A~1b"}, "self": {"$ref": "#/$defs/p/properties/const"}}}
    assert parts.root({"anyOf": [body]})["$defs"] == {"p:A/b": {"const": {"$ref": "#"}}, "p": body}
    assert json.loads(json.dumps(parts.root({"x": 1}))) == {"x": 1, "$defs": parts.defs}


def test_only_an_exact_call_of_a_declared_function_becomes_a_call():
    """With a format beside "auto" (json_object admits any object) an answer shaped roughly
    like a call stays the answer: the call branch writes exactly {"name", "arguments": {...}}."""
    from kvfence.server.tools import parse_answer
    spec = ToolSpec([TOOL], "auto", answer_schema='{"type":"object"}')
    content, calls = parse_answer('{"name":"f","arguments":{"x":1}}', spec)
    assert content is None and calls and calls[0]["function"] == {"name": "f", "arguments": '{"x":1}'}
    for text in ('{"name":"f","arguments":{"x":1},"extra":1}', '{"name":"f","arguments":"{\\"x\\":1}"}',
                 '{"arguments":{"x":1},"name":"f"}', '{"name":"g","arguments":{}}', '[1]', '{"name":"f"'):
        assert parse_answer(text, spec) == (text, None), text


def test_a_template_that_knows_tools_is_told_the_bare_call_form():
    """Such a template asks for its own call form (tags), which the answer-or-call grammar
    cannot produce; the system message says which form can."""
    from kvfence.server.tools import render
    spec = ToolSpec([TOOL], "auto", answer_schema='{"type":"object"}')
    msgs, tools = render([{"role": "user", "content": "hi"}], spec, template_has_tools=True)
    assert tools and msgs[0]["role"] == "system" and '{"name": "<function>"' in msgs[0]["content"]
    msgs, _ = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], spec, True)
    assert msgs[0]["content"].startswith("Be brief.\n\n") and len(msgs) == 2
    plain, _ = render([{"role": "user", "content": "hi"}], ToolSpec([TOOL], "auto"), template_has_tools=True)
    assert plain == [{"role": "user", "content": "hi"}]
