"""tools: tool_choice allowed_tools, "auto" or "required" over a subset of the declared
functions: every declared one is shown, only the listed ones can be called."""
from __future__ import annotations

import json

import jsonschema
import pytest

from kvfence.server.errors import APIError
from kvfence.server.tools import MAX_TOOLS, call_or_answer_schema, call_schema, parse_answer, parse_tools, render

TOOLS = [{"type": "function", "function": {"name": n, "description": f"does {n}", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}} for n in ("a", "b", "c")]
ASK = [{"role": "user", "content": "hi"}]


def _spec(mode: str, *names: str, parallel: bool = True):
    return parse_tools({"tools": TOOLS, "parallel_tool_calls": parallel, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {
            "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}})


def test_the_mode_is_the_choice_over_the_listed_functions():
    spec = _spec("required", "b", "c", "b")                      # a name listed twice counts once
    assert spec.choice == "required" and spec.enforced and spec.only == {"b", "c"}
    assert [t["name"] for t in spec.allowed()] == ["b", "c"] and [t["name"] for t in spec.shown()] == ["a", "b", "c"]
    auto = _spec("auto", "a")
    assert auto.choice == "auto" and not auto.enforced and [t["name"] for t in auto.allowed()] == ["a"]


@pytest.mark.parametrize("parallel", [True, False])
def test_the_call_schema_admits_only_the_listed_functions(parallel):
    schema = call_schema(_spec("required", "b", parallel=parallel))
    one = {"name": "b", "arguments": {"x": 1}}
    for call in (one, {"name": "a", "arguments": {"x": 1}}):
        doc = [call] if parallel else call
        if call["name"] == "b":
            jsonschema.validate(doc, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(doc, schema)
    both = call_or_answer_schema(_spec("auto", "b"), '{"type": "array"}')
    jsonschema.validate(one, both)
    jsonschema.validate([1], both)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "arguments": {"x": 1}}, both)


def test_under_auto_a_call_of_an_unlisted_function_is_not_a_call():
    spec = _spec("auto", "b")
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    assert parse_answer(text, spec) == (text, None)
    content, calls = parse_answer(text + '<tool_call>{"name": "b", "arguments": {"x": 2}}</tool_call>', spec)
    assert content == text and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("b", {"x": 2})]
    # beside a response_format the call is bare JSON: an unlisted name is the format's answer
    spec.answer_schema = '{"type": "object"}'
    bare = '{"name": "a", "arguments": {"x": 1}}'
    assert parse_answer(bare, spec) == (bare, None)
    content, calls = parse_answer(bare.replace('"a"', '"b"'), spec)
    assert content is None and [c["function"]["name"] for c in calls] == ["b"]


def test_every_declared_function_is_shown_and_the_listed_ones_named_last():
    """The generic prompt lists every function (as OpenAI keeps the whole list in the prompt),
    then says which may be called: the same prompt up to that sentence whatever the subset."""
    msgs, template_tools = render(ASK, _spec("required", "b"), template_has_tools=False)
    assert template_tools is None and msgs[0]["role"] == "system"
    text = msgs[0]["content"]
    assert all(f"- {n}: does {n}" in text for n in "abc")
    assert text.endswith("You must call one of these functions now: b.")
    other, _ = render(ASK, _spec("auto", "a", "c"), template_has_tools=False)
    assert other[0]["content"].endswith("Only these functions may be called now: a, c.")
    head = text.rsplit("\n", 1)[0]
    assert other[0]["content"].rsplit("\n", 1)[0] == head
    # a named function shows only itself, as before
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "b"}}})
    msgs, _ = render(ASK, named, template_has_tools=False)
    assert "- a:" not in msgs[0]["content"] and msgs[0]["content"].endswith("You must call b now.")


def test_a_template_that_reads_tools_gets_them_all_and_the_sentence():
    msgs, template_tools = render(ASK, _spec("auto", "c"), template_has_tools=True)
    assert [t["function"]["name"] for t in template_tools] == ["a", "b", "c"]
    assert msgs[0] == {"role": "system", "content": "Only these functions may be called now: c."}
    msgs, _ = render([{"role": "system", "content": "Be brief."}, *ASK], _spec("required", "a"), True)
    assert msgs[0]["content"] == "Be brief.\n\nYou must call one of these functions now: a."


@pytest.mark.parametrize("choice,param", [
    ({"type": "allowed_tools"}, "tool_choice.allowed_tools"),
    ({"type": "allowed_tools", "allowed_tools": []}, "tool_choice.allowed_tools"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "none", "tools": [
        {"type": "function", "function": {"name": "a"}}]}}, "tool_choice.allowed_tools.mode"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": ["auto"], "tools": [
        {"type": "function", "function": {"name": "a"}}]}}, "tool_choice.allowed_tools.mode"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}, "tool_choice.allowed_tools.tools"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": {}}}, "tool_choice.allowed_tools.tools"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["a"]}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": 1}}]}}, "tool_choice.allowed_tools.tools[0]"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "d"}}]}},
     "tool_choice.allowed_tools.tools[1].function.name"),
    ({"type": "allowed", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice"),
    # no longer than 'tools' may be, before any entry is read (an 8 MiB list took ~0.6 s, found in review)
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "a"}}] * (MAX_TOOLS + 1)}}, "tool_choice.allowed_tools.tools"),
])
def test_a_malformed_allowed_tools_is_a_400_that_names_it(choice, param):
    with pytest.raises(APIError) as e:
        parse_tools({"tools": TOOLS, "tool_choice": choice})
    assert e.value.status == 400 and e.value.param == param


def test_the_responses_form_is_bounded_before_its_entries_are_read():
    from kvfence.server.responses_api import _tool_choice

    with pytest.raises(APIError) as e:
        _tool_choice({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "a"}] * 65})
    assert e.value.status == 400 and e.value.param == "tool_choice.tools"


@pytest.mark.parametrize("spec", [_spec("required", "a"), _spec("auto", "a")], ids=["enforced", "free"])
def test_model_text_nested_past_the_parser_is_text_not_a_500(spec):
    """Found in review: a recursive $ref lets the grammar write deeper nesting than Python's JSON
    parser recurses; parse_answer raised RecursionError after the whole generation (a 500)."""
    deep = "[" * 100_000 + "]" * 100_000
    for text in (deep, f'<tool_call>{{"name": "a", "arguments": {{"x": {deep}}}}}</tool_call>',
                 f'{{"name": "a", "arguments": "{deep}"}}'):
        content, calls = parse_answer(text, spec)
        assert calls is None and content == text


CUT = '{"city": "Par'   # a call cut by max_tokens: its arguments are not JSON


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_call_with_unfinished_arguments_is_sent_back_as_the_text_it_was(api):
    """A client sends an earlier call back as it got it, with its tool's error as the result (the
    Agents SDK, LangChain's invalid calls): OpenAI takes arguments that are not JSON, and so does
    kvfence, writing them back as that string; JSON arguments are written back as the object."""
    from kvfence.server.protocol import parse_chat
    from kvfence.server.responses_api import chat_body

    if api == "chat":
        body = {"model": "m", "tools": TOOLS, "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": CUT}},
            {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "An error occurred while running the tool."},
            {"role": "tool", "tool_call_id": "call_2", "content": "2"}]}
    else:
        body = chat_body({"model": "m", "tools": [{"type": "function", **t["function"]} for t in TOOLS], "input": [
            *ASK, {"type": "function_call", "call_id": "call_1", "name": "a", "arguments": CUT},
            {"type": "function_call", "call_id": "call_2", "name": "b", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "An error occurred."},
            {"type": "function_call_output", "call_id": "call_2", "output": "2"}]})
    req = parse_chat(body)
    calls = req.messages[1]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("a", CUT), ("b", {"x": 1})]
    rendered, tools = render(req.messages, req.tools, template_has_tools=False)
    assert tools is None and [m["role"] for m in rendered] == ["system", "user", "assistant", "user", "user"]
    assert rendered[2]["content"] == ('<tool_call>{"name": "a", "arguments": "{\\"city\\": \\"Par"}</tool_call>'
                                      '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    with pytest.raises(APIError, match="JSON text"):   # arguments still have to be text
        parse_chat({**body, "messages": [*ASK, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "a", "arguments": {"x": 1}}}]}]})
