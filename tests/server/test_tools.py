"""Tools through the server with the official openai client: required and named calls are
held to the declared functions and their parameter schemas by the grammar, come back as
OpenAI tool_calls (streamed too), and a follow-up with the tool's result is answered."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_harness import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TAGS = {"type": "function", "function": {   # a set[str] in pydantic: uniqueItems, which the grammar cannot hold
    "name": "tag", "strict": True, "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
NOT_TOOL = {"type": "function", "function": {"name": "pick", "strict": True, "parameters": {
    "type": "object", "properties": {"v": {"type": "string", "not": {"const": "x"}}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _valid(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_returns_valid_calls_of_declared_functions(server):
    c = server.client("alice")
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                  max_tokens=96, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.function.name in SCHEMAS
        _valid(call)


def test_a_tool_not_declared_strict_is_called_with_what_the_grammar_can_hold(server):
    # strict is each tool's own: a strict one beside it does not make its set[str] a 400 (review)
    tags = {"type": "function", "function": {**TAGS["function"], "strict": False}}
    weather = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    r = server.client("alice").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tag this post about Python."}], tools=[weather, tags],
        tool_choice={"type": "function", "function": {"name": "tag"}}, max_tokens=64, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "tag"
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args, dict) and all(isinstance(t, str) for t in args.get("tags", []))


def test_the_deprecated_functions_form_is_answered_in_its_own_form(server):
    """functions / function_call / function messages (LiteLLM passes them through; older
    LangChain chains and instructor's FUNCTIONS mode send them) were a 400; the answer's one
    call comes back as message.function_call with finish_reason function_call."""
    c = server.client("alice")
    fn, force = WEATHER["function"], {"name": "get_weather"}
    r = c.chat.completions.create(model=MODEL, messages=ASK, functions=[fn], function_call=force, max_tokens=64,
                                  temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call" and msg.tool_calls is None, r
    jsonschema.validate(json.loads(msg.function_call.arguments), SCHEMAS["get_weather"])
    assert msg.function_call.name == "get_weather"
    name, args, finish = "", "", None   # streamed: its pieces, in delta.function_call
    for chunk in c.chat.completions.create(model=MODEL, messages=ASK, functions=[fn], function_call=force,
                                           max_tokens=64, temperature=0, stream=True):
        d = chunk.choices[0].delta
        assert not d.tool_calls
        if d.function_call:
            name, args = name + (d.function_call.name or ""), args + (d.function_call.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == ("get_weather", msg.function_call.arguments, "function_call")
    # the call and its result go back in the same form: the answer reads the result
    turn = ASK + [{"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                           "arguments": '{"city":"Paris"}'}},
                  {"role": "function", "name": "get_weather", "content": "18 degrees and sunny"}]
    prompt = c.chat.completions.create(model=MODEL, messages=turn, functions=[fn], max_tokens=1).usage.prompt_tokens
    as_tools = c.chat.completions.create(model=MODEL, max_tokens=1, tools=[WEATHER], parallel_tool_calls=False,
                                         messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_fn1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_fn1", "content": "18 degrees and sunny"}]).usage.prompt_tokens
    assert prompt == as_tools   # the same conversation, rendered the same


def test_a_named_function_is_the_one_called(server):
    c = server.client("bob")
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=64, temperature=0.7,
                                  seed=5, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_time" and _valid(calls[0])["zone"] in ("UTC", "CET", "PST")


def test_streamed_calls_arrive_as_deltas(server):
    c = server.client("alice")
    stream = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True, max_tokens=64,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                e = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_enforced_calls_stream_as_they_are_generated(server, choice):
    """OpenAI's shape: a call's first delta has its index, id, type, name and empty arguments;
    the following ones pieces of its arguments, as the tokens come. Together they are the
    unstreamed answer's calls (greedy, so the same tokens)."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=96, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    deltas, finish = [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id.startswith("call_") and d.type == "function" and d.function.name in SCHEMAS
            assert d.function.arguments == ""
            calls[d.index] = {"name": d.function.name, "arguments": ""}
        else:
            assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments
    assert len(deltas) > 2 * len(calls)          # arguments in pieces, not one delta at the end
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]


def _streamed_answer(c, **kw) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A streamed answer's content, calls ((name, arguments), added up from their deltas) and
    finish_reason."""
    text, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function" and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    calls[d.index][1] += d.function.arguments
            finish = ch.finish_reason or finish
    return text or None, [(n, a) for n, a in calls.values()], finish


@pytest.mark.parametrize("max_tokens", [3, 8, 11, 12])
def test_a_forced_call_cut_short_by_max_tokens_is_the_same_call_streamed_or_not(server, max_tokens):
    """As OpenAI: a forced call cut short comes back as a tool call with its arguments so far
    (not valid JSON: that is how a client sees the cut) and finish_reason length, content null,
    unstreamed as streamed. Unstreamed it used to be the text ('{"name":"get_weather",
    "arguments":{"city' at 11), and with 8 tokens ('{"name":"get_weather","arguments') the
    stream sent the text too: a call is one as soon as its name is closed. Cut before that (3
    tokens: '[{"name":"get_') the one function allowed is the call, no arguments yet: that
    text, the server's own grammar, used to be the assistant's content (found by a probe)."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=max_tokens, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length"
    calls = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert _streamed_answer(c, **kw) == (whole.message.content, calls, "length")
    assert whole.message.content is None and [n for n, _ in calls] == ["get_weather"]
    assert whole.message.tool_calls[0].id.startswith("call_") and whole.message.tool_calls[0].type == "function"
    args = calls[0][1]
    assert args == "" if max_tokens <= 8 else args.startswith('{"city')
    with pytest.raises(ValueError):
        json.loads(args)


def test_a_cut_call_sent_back_with_its_tools_error_is_answered(server):
    """The server's own cut call (arguments not JSON) goes back to it as a client gets it, with the
    tool's error as its result, as the Agents SDK does after a tool fails to parse it: answered,
    not a 400 (it was one, so every later turn of such a conversation failed)."""
    c = server.client("alice")
    cut = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=11, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length" and msg.tool_calls
    with pytest.raises(ValueError):
        json.loads(msg.tool_calls[0].function.arguments)
    again = c.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=16, temperature=0, messages=[
        *ASK, msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "An error occurred while running the tool."}])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > cut.usage.prompt_tokens


def test_an_auto_answer_streams_its_text_as_generated(server):
    """With tools declared (auto), a text answer used to arrive in one chunk at its end (found
    by a probe); it streams as generated, and adds up to the unstreamed answer. Only a
    <tool_call> tag (and what follows) waits for the answer's end."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              tools=[WEATHER], max_tokens=40, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.message.tool_calls is None and whole.message.content, whole
    pieces = [ch.delta.content for chunk in c.chat.completions.create(stream=True, **kw)
              for ch in chunk.choices if ch.delta.content]
    assert len(pieces) > 5 and "".join(pieces) == whole.message.content, pieces


def test_a_forced_call_cut_by_a_stop_string_says_stop_not_tool_calls(server):
    """A stop string cut the call's arguments: finish_reason tool_calls told the client they
    were whole (json.loads then failed on them; found in review). As max_tokens says length,
    the stop says stop, streamed or not."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0, stop=['"city'],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and [t.function.name for t in whole.message.tool_calls] == ["get_weather"]
    with pytest.raises(ValueError):
        json.loads(whole.message.tool_calls[0].function.arguments)
    calls = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert _streamed_answer(c, **kw) == (None, calls, "stop")
    done = c.chat.completions.create(**{**kw, "stop": None}).choices[0]   # uncut: whole calls
    assert done.finish_reason == "tool_calls" and json.loads(done.message.tool_calls[0].function.arguments)


def test_a_required_call_cut_before_its_name_among_several_tools_is_no_text_and_no_call(server):
    """Which of two tools it would have called is unknown when the cut came inside the name:
    no call, and not the grammar's wrapper as content either; streamed the same."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=3, temperature=0,
              tool_choice="required")
    whole = c.chat.completions.create(**kw).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (None, None, "length"), whole
    assert _streamed_answer(c, **kw) == (None, [], "length")


# the parameters LangChain's bind_tools and pydantic write for get_weather(city, unit):
# no "additionalProperties", so JSON Schema lets the object carry any other key
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
                   "required": ["city", "unit"]}}}


def _streamed_calls(c, **kw) -> tuple[list[dict], str | None]:
    """A streamed answer's calls, each {"name", "arguments"} added up from its deltas, and
    its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_leaves_objects_open_still_gets_a_call(server, stream):
    """Held to the open schema as written, greedy SmolLM2 went on after city and unit with keys
    of its own ("properties", "description", ...) until max_tokens: finish_reason length and no
    call. kvfence closes objects that do not ask to be open (engine/closed_schema.py), so the
    call ends after the declared keys."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[OPEN_WEATHER], tool_choice="required", max_tokens=64, temperature=0)
    if stream:
        got, finish = _streamed_calls(c, **kw)
        assert finish == "tool_calls", got
    else:
        r = c.chat.completions.create(**kw).choices[0]
        assert r.finish_reason == "tool_calls", r.message.content
        got = [{"name": t.function.name, "arguments": t.function.arguments} for t in r.message.tool_calls]
    assert got
    for call in got:
        assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city", "unit"}


def test_a_follow_up_with_the_tool_result_is_answered(server):
    c = server.client("alice")
    first = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0,
                                      tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # the result reaches the model: the prompt is longer than without it
    bare = c.chat.completions.create(model=MODEL, messages=messages[:2], tools=[WEATHER], max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens


def test_none_hides_the_tools_and_auto_answers(server):
    c = server.client("bob")
    plain = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    none = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8,
                                     temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    auto = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0)
    m = auto.choices[0].message
    assert m.content or m.tool_calls
    for call in m.tool_calls or []:
        _valid(call)


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_tools_required_calls_only_the_allowed_ones(server, stream):
    """tool_choice allowed_tools (OpenAI's; it was a 400): with mode required the answer is a
    call of a listed function, whatever the model would have picked among all those declared.
    Asked for the weather with both tools declared, greedy SmolLM2 calls get_weather; allowed
    only get_time, the grammar holds it to get_time."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=96, temperature=0)
    free = c.chat.completions.create(tool_choice="required", **kw).choices[0].message.tool_calls
    assert "get_weather" in [t.function.name for t in free]
    kw["tool_choice"] = _allowed("required", "get_time")
    if stream:
        content, calls, finish = _streamed_answer(c, **kw)
    else:
        ch = c.chat.completions.create(**kw).choices[0]
        content, finish = ch.message.content, ch.finish_reason
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    assert finish == "tool_calls" and content is None and calls
    for name, args in calls:
        assert name == "get_time"
        jsonschema.validate(json.loads(args), SCHEMAS["get_time"])


def test_allowed_tools_auto_keeps_every_tool_in_the_prompt_and_calls_only_allowed_ones(server):
    """mode auto: the model may answer or call a listed function. Every declared function is
    still in the prompt (OpenAI keeps the whole list, so changing the subset keeps the prompt's
    prefix); with a response_format beside it the grammar admits the format's answer or a call of
    a listed function only: no answer can start here, and the call is get_time though the user
    asks for the weather."""
    c = server.client("bob")
    kw = dict(model=MODEL, messages=ASK, max_tokens=48, temperature=0)
    auto = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice=_allowed("auto", "get_time"), **kw)
    for t in auto.choices[0].message.tool_calls or []:
        assert t.function.name == "get_time"
    only_time = c.chat.completions.create(tools=[TIME], **kw)
    assert auto.usage.prompt_tokens > only_time.usage.prompt_tokens + 40     # get_weather's schema is there too
    ch = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice=_allowed("auto", "get_time"),
                                   response_format=LIST, logit_bias=_banned(server, "["),
                                   **{**kw, "max_tokens": 96}).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [t.function.name for t in ch.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), SCHEMAS["get_time"])


@pytest.mark.parametrize("extra,param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice.allowed_tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "none", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}},
     "tool_choice.allowed_tools.mode"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}}, "tool_choice.allowed_tools.mode"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.allowed_tools.tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": "get_weather"}}}, "tool_choice.allowed_tools.tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {   # the Responses form
        "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "custom", "custom": {"name": "get_weather"}}]}}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {"name": "nope"}}]}}}, "tool_choice.allowed_tools.tools[1].function.name"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}}, "tool_choice"),
    # each tool judged as the combined schema holds it: a set[str] in a tool not strict is no
    # fault, the strict one's `not` is (the raw parameters blamed tools[0]; found in review)
    ({"tools": [{"type": "function", "function": {**TAGS["function"], "strict": False}}, NOT_TOOL],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"functions": [{**TAGS["function"], "strict": False}, NOT_TOOL["function"]], "function_call": "auto",
      "response_format": {"type": "json_object"}}, "functions[1].parameters"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),       # both forms at once
    ({"functions": [{"name": "bad name!"}]}, "functions[0].name"),                   # named as sent
    ({"function_call": "auto"}, "function_call"),
    ({"messages": ASK + [{"role": "function", "name": "f", "content": "x"}]}, "messages[1]"),   # answers no call
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "xml"}}, "response_format"),
    # with "auto" the answer may be the format's: a format the grammar cannot hold is named as such
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"tools": [TAGS], "response_format": {"type": "json_object"}}, "tools[0].function.parameters"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    # a schema the grammar cannot enforce is named where the client wrote it, not response_format
    ({"tools": [WEATHER, TAGS], "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [TAGS, WEATHER], "tool_choice": {"type": "function", "function": {"name": "tag"}}},
     "tools[0].function.parameters"),
    # arguments are JSON text (a string); text that is not JSON is written back as it is (a cut call)
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]},
     "messages[1].tool_calls[0]"),
])
def test_malformed_tools_are_400s_that_name_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, **extra}
    r = httpx.post(server.base_url + "/chat/completions", json=body,
                   headers={"authorization": "Bearer sk-alice-0001"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_null_means_not_set_in_tools(server):
    """Clients that serialize pydantic models send None for what they leave out; OpenAI takes
    null as absent for these (the SDK's own Responses FunctionToolParam types parameters and
    strict as nullable)."""
    tool = {"type": "function", "function": {"name": "ping", "description": None, "parameters": None,
                                             "strict": None}}
    body = {"model": MODEL, "messages": ASK, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": None,
            "max_tokens": 16, "temperature": 0}
    headers = {"authorization": "Bearer sk-alice-0001"}
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": None}}
    r = httpx.post(server.base_url + "/chat/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "messages": ASK, "response_format": fmt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    resp = server.client("alice").responses.create(
        model=MODEL, input="ping", max_output_tokens=16, tool_choice="required",
        tools=[{"type": "function", "name": "ping", "parameters": None, "strict": None}])
    assert resp.status in ("completed", "incomplete")


@pytest.mark.parametrize("choice,max_tokens", [
    ("required", 96),                                                     # calls streamed as generated
    ({"type": "function", "function": {"name": "get_weather"}}, 12),     # cut short inside its call
    ("auto", 48),                                                         # the answer sent at its end
])
def test_streamed_tool_answers_carry_the_logprobs_an_unstreamed_one_has(server, choice, max_tokens):
    """Every generated token's logprob, sent with the deltas it made (or with the answer, when
    the answer is sent whole): streamed, they add up to the unstreamed answer's, greedy. (The
    second request reads the first one's prompt pages from the prefix cache, so its numbers may
    differ in the last bits.)"""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=max_tokens,
              temperature=0, logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**kw).choices[0]
    want = [(x.token, x.logprob, [t.token for t in x.top_logprobs]) for x in whole.logprobs.content]
    got, finish = [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                got += [(x.token, x.logprob, [t.token for t in x.top_logprobs]) for x in ch.logprobs.content]
            finish = ch.finish_reason or finish
    assert finish == whole.finish_reason
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want] and len(got) > 0
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-3)


def test_parallel_calls_cut_short_keep_every_call_begun_unstreamed_too(server):
    """A small model often goes on to a second call; cut short inside it, the stream has sent
    the finished calls and the unfinished one's arguments so far, and the unstreamed answer is
    the same calls (it was the raw JSON text, then only the finished calls), with finish_reason
    length in both. The array's closing ']' is biased away so the model must go on."""
    tok = server.engine.tokenizer
    vocab = tok.hf.get_vocab()
    closers = {i: -100 for s, i in vocab.items() if "]" in s and set(s) <= set("}],")}
    assert closers
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[TIME], tool_choice="required", temperature=0, logit_bias=closers,
              max_tokens=60)
    first = c.chat.completions.create(**kw).choices[0]
    one = len(tok.encode('[{"name":"get_time","arguments":{"zone":"UTC"}}', add_special=False))
    assert first.finish_reason == "length" and first.message.tool_calls and first.message.content is None, first
    names = [t.function.name for t in first.message.tool_calls]
    assert names == ["get_time"] * len(names) and 1 <= len(names) <= 60 // one + 1
    for t in first.message.tool_calls[:-1]:
        _valid(t)
    calls = [(t.function.name, t.function.arguments) for t in first.message.tool_calls]
    assert _streamed_answer(c, **kw) == (None, calls, "length")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_tool_whose_parameters_use_defs_is_enforced(server, choice):
    """pydantic (and openai.pydantic_function_tool) puts nested models in $defs and points at
    them with "#/$defs/...". Nested under the call schema those refs pointed at its root, which
    has no $defs: a valid tool got a 400 (found in review)."""
    import openai
    from pydantic import BaseModel

    class Place(BaseModel):
        city: str
        country: str

    class Trip(BaseModel):
        start: Place
        end: Place

    trip = openai.pydantic_function_tool(Trip, name="plan_trip")
    assert "$defs" in trip["function"]["parameters"]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "plan_trip"}}
    r = server.client("alice").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A trip from Paris to Rome."}], tools=[TIME, trip],
        tool_choice=tool_choice, max_tokens=80, temperature=0)
    ch = r.choices[0]
    assert ch.message.tool_calls, ch
    for call in ch.message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "plan_trip":
            Trip.model_validate(args)
            jsonschema.validate(args, trip["function"]["parameters"])


LIST = {"type": "json_schema", "json_schema": {"name": "cities", "schema": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}}


def _banned(server, first: str) -> dict[str, int]:
    """logit_bias that bans every token whose text starts with `first`: with a grammar that
    admits an answer starting with '[' or a call starting with '{', banning one picks the other
    on any CPU (a greedy choice between them would hang on kernels' last bits)."""
    tok = server.engine.tokenizer
    ids = [i for i in range(tok.vocab_size) if tok.decode([i]).startswith(first)]
    assert 0 < len(ids) <= 1024
    return {str(i): -100 for i in ids}


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_format_and_a_required_choice_give_the_call(server, stream):
    """OpenAI's response_format governs text; a forced call has none (the Agents SDK sends both
    for an agent with an output_type and tool_choice="required", instructor's RESPONSES_TOOLS
    always). It used to be a 400."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0,
              response_format=LIST)
    if stream:
        calls, finish = _streamed_calls(c, **kw)
        assert finish == "tool_calls" and calls
        for e in calls:
            jsonschema.validate(json.loads(e["arguments"]), SCHEMAS[e["name"]])
    else:
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        for call in ch.message.tool_calls:
            _valid(call)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_a_response_format_answers_in_the_format_or_calls(server, stream):
    """With "auto" and a response_format the grammar admits the format's answer or one call of
    a declared function, as OpenAI lets the model choose (an agent with tools and an output
    type): before, the format held every answer and no tool could ever be called."""
    c = server.client("bob")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=96, temperature=0, response_format=LIST)

    def ask(bias):
        if not stream:
            ch = c.chat.completions.create(logit_bias=bias, **kw).choices[0]
            return ch.message.content, ch.message.tool_calls, ch.finish_reason
        text, calls, finish = "", [], None
        for chunk in c.chat.completions.create(logit_bias=bias, stream=True, **kw):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        return text or None, calls or None, finish

    content, calls, finish = ask(_banned(server, "["))       # no answer can start: a call
    if stream:   # the SDK's helper assembles the stream as the unstreamed answer says
        with c.chat.completions.stream(logit_bias=_banned(server, "["), **kw) as s:
            assert s.get_final_completion().choices[0].message.content is None
        with c.chat.completions.stream(logit_bias=_banned(server, "{"), **kw) as s:
            assert json.loads(s.get_final_completion().choices[0].message.content)
    assert finish == "tool_calls" and content is None and len(calls) == 1
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])
    content, calls, finish = ask(_banned(server, "{"))       # no call can start: the format's answer
    assert calls is None and finish == "stop"                  # 3 items of 12 characters fit in 96 tokens
    jsonschema.validate(json.loads(content), LIST["json_schema"]["schema"])


def test_responses_take_an_empty_tools_list_as_none(server):
    """The Agents SDK sends "tools": [] for an agent without tools, and its default model
    speaks the Responses API: every tool-less agent got a 400. Chat completions still refuses
    [] (OpenAI's does too)."""
    c = server.client("alice")
    r = c.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, tools=[], tool_choice="auto",
                           temperature=0)
    plain = c.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    assert r.output_text == plain.output_text and r.tools == []
    for choice in ("required", {"type": "function", "name": "x"}):
        body = {"model": MODEL, "input": "hi", "tools": [], "tool_choice": choice}
        bad = httpx.post(server.base_url + "/responses", json=body, timeout=30,
                         headers={"authorization": "Bearer sk-alice-0001"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice", bad.text
    bad = httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, "messages": ASK, "tools": []},
                     headers={"authorization": "Bearer sk-alice-0001"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text


def test_responses_with_a_text_format_and_a_named_function_give_the_call(server):
    """instructor's RESPONSES_TOOLS mode sends both on every call."""
    fmt = {"format": {"type": "json_schema", "name": "ok", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    tool = {"type": "function", **WEATHER["function"]}
    r = server.client("alice").responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                                tool_choice={"type": "function", "name": "get_weather"}, text=fmt,
                                                max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])


def test_a_streamed_enforced_answer_assembles_with_null_content(server):
    """The SDK's stream helper assembles the message from the deltas: an answer that is calls
    by construction says content null, as the unstreamed one does (it used to assemble "")."""
    c = server.client("alice")
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0)
    with c.chat.completions.stream(**kw) as s:
        streamed = s.get_final_completion().choices[0].message
    whole = c.chat.completions.create(**kw).choices[0].message
    assert streamed.content is None and whole.content is None
    assert [t.function.arguments for t in streamed.tool_calls] == [t.function.arguments for t in whole.tool_calls]
