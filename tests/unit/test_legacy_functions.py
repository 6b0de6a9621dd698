"""OpenAI's deprecated function calling, read as tools and answered in its own form: the
request's rewriting, the errors named as the client sent them, and the answer's shape, whole
and streamed (the streamed pieces of one delta joined: a head and its first arguments came in
one update and the arguments were lost; found in review)."""
from __future__ import annotations

import pytest

from kvfence.server.errors import APIError
from kvfence.server.legacy_functions import as_tools
from kvfence.server.openai_format import Formatter
from kvfence.server.protocol import parse_chat

FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_the_request_is_read_as_tools_with_one_call():
    body, legacy = as_tools({"messages": ASK + [
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "sunny"}],
        "functions": [FN], "function_call": {"name": "get_weather"}})
    assert legacy and body["tools"] == [{"type": "function", "function": FN}] and body["parallel_tool_calls"] is False
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    call = body["messages"][1]["tool_calls"][0]
    assert body["messages"][2] == {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    assert "functions" not in body and "function_call" not in body
    assert parse_chat(body).tools.choice == "function"
    assert as_tools({"messages": ASK}) == ({"messages": ASK}, False)


@pytest.mark.parametrize("body,param,says", [
    ({"functions": []}, "functions", "'functions' must be a non-empty array"),
    ({"functions": [{"name": "bad name!"}]}, "functions[0].name", "'functions[0].name' must be"),
    ({"functions": [FN, FN]}, "functions[1].name", "'functions[1].name'"),
    ({"functions": [FN], "function_call": {"name": "tool_choice"}}, "function_call",
     "names function 'tool_choice'"),                      # a function's name is not renamed
    ({"functions": [FN], "function_call": [1]}, "function_call", "'function_call' must be"),
    ({"functions": [FN], "tools": [{"type": "function", "function": FN}]}, "functions", "not both"),
    ({"messages": ASK + [{"role": "assistant", "function_call": "f"}]}, "messages[1].function_call",
     "'messages[1].function_call' must be"),
])
def test_a_refusal_names_the_fields_as_sent(body, param, says):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": ASK, **body})
    assert e.value.param == param and says in e.value.message, (e.value.param, e.value.message)


def test_the_answer_comes_back_as_function_call():
    f = Formatter("chat", "id", "m", "fp", str, legacy_functions=True)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    choice = f.response([(None, "tool_calls", None, [call])], {})["choices"][0]
    assert choice["message"]["function_call"] == call["function"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "function_call"
    # one update with the call's head and its first arguments: both in the one delta
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    piece = {"index": 0, "function": {"arguments": '{"city":"Pa'}}
    delta = f.chunk(None, None, None, False, call_deltas=[head, piece])["choices"][0]["delta"]
    assert delta["function_call"] == {"name": "get_weather", "arguments": '{"city":"Pa'}
    assert f.chunk(None, "tool_calls", None, False)["choices"][0]["finish_reason"] == "function_call"
