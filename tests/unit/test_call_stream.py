"""tools.CallStream: enforced tool calls as OpenAI streams them, whatever the text's pieces."""
from __future__ import annotations

import json

import pytest

from kvfence.server.tools import CallStream

ONE = '{"name":"get_weather","arguments":{"city":"Pa\\"r}is [x]","unit":"celsius"}}'
TWO = '[{"name":"get_weather","arguments":{"city":"Paris","n":{"a":[1,2]}}},{"name":"get_time","arguments":{}}]'


@pytest.mark.parametrize("text", [ONE, TWO])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_pieces_add_up_to_the_calls(text, step):
    cs, calls = CallStream(), {}
    for i in range(0, len(text), step):
        for d in cs.feed(text[i:i + step]):
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    want = json.loads(text)
    want = want if isinstance(want, list) else [want]
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(w["name"], w["arguments"]) for w in want]
    assert cs.calls == len(want)


def test_text_before_a_call_is_complete_starts_nothing():
    cs = CallStream()
    assert cs.feed('{"name":"get_wea') == [] and cs.calls == 0
    (d,) = cs.feed('ther","arguments":')
    assert d["function"] == {"name": "get_weather", "arguments": ""}


def _spec(choice="auto", parallel=True):
    from kvfence.server.tools import ToolSpec

    return ToolSpec([{"name": "get_weather", "description": "", "parameters": {}},
                     {"name": "get_time", "description": "", "parameters": {}}], choice, None, parallel)


@pytest.mark.parametrize("text,content,calls", [
    # the model stopped right after its JSON: no closing tag (vLLM's Hermes parser takes it too)
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Oslo"}}', "Sure.", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    # arguments in OpenAI's wire form: a JSON string holding the object
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Rome"})]),
    # not calls: text stays text
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Ro', None, None),
    ('<tool_call>{"name": "nope", "arguments": {}}', None, None),
    ('<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>', None, None),
])
def test_auto_answers_are_read_as_calls(text, content, calls):
    from kvfence.server.tools import parse_answer

    got_content, got_calls = parse_answer(text, _spec())
    if calls is None:
        assert got_calls is None and got_content == text
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls


def test_unstreamed_arguments_are_compact_json_like_streamed_ones():
    from kvfence.server.tools import parse_answer

    _, calls = parse_answer(ONE, _spec("required"))
    streamed = "".join(d["function"].get("arguments", "") for d in CallStream().feed(ONE))
    assert calls[0]["function"]["arguments"] == streamed == json.dumps(json.loads(ONE)["arguments"],
                                                                         separators=(",", ":"))


THREE = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Pa}],is"}},' \
        '{"name":"get_time","arguments":{}}]'


@pytest.mark.parametrize("cut,names", [
    (THREE.index('{"name":"get_weather"'), ["get_time"]),               # after the first call's ','
    (THREE.index('Pa}],is'), ["get_time"]),                             # inside the second's arguments
    (THREE.index('is"}}') + 5, ["get_time", "get_weather"]),            # the second closed, no ',' yet
    (len(THREE) - 4, ["get_time", "get_weather"]),                      # inside the third
])
def test_parallel_calls_cut_short_keep_the_calls_they_finished(cut, names):
    """A small model goes on to another call after the first; cut short by max_tokens, the
    unstreamed answer was the raw JSON text and the finished calls were lost (the stream had
    sent them). The finished calls are kept; the unfinished one is dropped."""
    from kvfence.server.tools import parse_answer

    content, calls = parse_answer(THREE[:cut], _spec("required"))
    assert content is None and [c["function"]["name"] for c in calls] == names
    assert [json.loads(c["function"]["arguments"]) for c in calls][1:] == [{"city": "Pa}],is"}][:len(names) - 1]


def test_a_single_call_cut_short_is_text():
    from kvfence.server.tools import parse_answer

    cut = ONE[:-5]
    assert parse_answer(cut, _spec("required")) == (cut, None)
    assert parse_answer("[" + cut, _spec("required")) == ("[" + cut, None)


def test_tools_nested_too_deeply_are_a_400_not_a_crash():
    """Moving a tool's $refs walks its schema; one nested to the interpreter's recursion limit
    is the client's 400 (param tools), not a 500."""
    import sys

    from kvfence.server.errors import APIError
    from kvfence.server.protocol import parse_chat

    deep: dict = {}
    cur = deep
    for _ in range(400):
        cur["items"] = {}
        cur = cur["items"]
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(350)
    try:
        with pytest.raises(APIError) as e:
            parse_chat(body)
    finally:
        sys.setrecursionlimit(limit)
    assert e.value.status == 400 and e.value.param == "tools"


@pytest.mark.parametrize("reason,calls,enforced,want", [
    ("stop", True, True, "tool_calls"),
    ("length", True, True, "length"),      # parallel calls cut short: the last one is unfinished
    ("stop", True, False, "tool_calls"),
    ("length", True, False, "tool_calls"),  # auto: a whole call, then text cut short (found in review)
    ("length", False, False, "length"),
    ("stop", False, True, "stop"),
    (None, False, False, "stop"),
])
def test_finish_reason(reason, calls, enforced, want):
    from kvfence.server.app import finish_reason

    assert finish_reason(reason, calls, enforced) == want
