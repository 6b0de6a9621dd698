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


@pytest.mark.parametrize("cut,calls", [
    (THREE.index('{"name":"get_weather"'), [("get_time", "{}")]),                      # after the first call's ','
    (THREE.index('"get_weather"') + 12, [("get_time", "{}")]),                        # the second's name open
    (THREE.index('"get_weather"') + 13, [("get_time", "{}"), ("get_weather", "")]),   # ... closed
    (THREE.index('"get_weather"') + 20, [("get_time", "{}"), ("get_weather", "")]),   # inside ',"arguments":'
    (THREE.index('Pa}],is'), [("get_time", "{}"), ("get_weather", '{"city":"')]),    # inside its arguments
    (THREE.index('is"}}') + 5, [("get_time", "{}"), ("get_weather", '{"city":"Pa}],is"}')]),   # closed, no ','
    (len(THREE) - 3, [("get_time", "{}"), ("get_weather", '{"city":"Pa}],is"}'), ("get_time", "{")]),
])
def test_parallel_calls_cut_short_keep_every_call_begun(cut, calls):
    """A small model goes on to another call after the first; cut short by max_tokens, the
    unstreamed answer keeps every call whose name is closed, the last one with its arguments so
    far, as the stream sent them (it used to drop the unfinished one)."""
    from kvfence.server.tools import parse_answer

    content, got = parse_answer(THREE[:cut], _spec("required"))
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert len({c["id"] for c in got}) == len(got) and all(c["id"].startswith("call_") for c in got)


def _streamed(text: str) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in CallStream().feed(text):
        calls.setdefault(d["index"], [d["function"].get("name", ""), ""])[1] += d["function"]["arguments"]
    return [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("text", [ONE, TWO, THREE])
def test_a_cut_answer_is_what_its_stream_sent(text):
    """Cut short anywhere, the unstreamed answer is the streamed one: the calls begun (a name
    closed) with their arguments as generated, content null (max_tokens 8 gave
    '{"name":"get_weather","arguments' as content streamed, and max_tokens 11 the text
    unstreamed but a call streamed). Before the first name closes the text is never content:
    the one function whose name fits the part written is the call, none when both fit."""
    from kvfence.server.tools import parse_answer

    start = text.index('"name":"') + 8
    head = text.index('"', start) + 1      # the first name's closing quote
    for cut in range(1, len(text)):
        content, calls = parse_answer(text[:cut], _spec("required"))
        if cut < head:
            fits = [n for n in ("get_weather", "get_time") if n.startswith(text[start:cut])] if cut > start else [1, 2]
            assert content is None and _streamed(text[:cut]) == [], cut
            want = [{"name": n, "arguments": ""} for n in fits if len(fits) == 1]
            assert [c["function"] for c in calls or []] == want, cut
        else:
            assert content is None and calls, cut
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == _streamed(text[:cut])


def test_a_call_is_named_once_its_name_is_closed():
    cs = CallStream()
    (d,) = cs.feed('{"name":"get_weather","argu')
    assert d["function"] == {"name": "get_weather", "arguments": ""} and cs.calls == 1
    assert cs.feed('ments"') == []
    assert cs.feed(':{"ci') == [{"index": 0, "function": {"arguments": '{"ci'}}]


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


@pytest.mark.parametrize("reason,calls,cut,want", [
    ("stop", True, False, "tool_calls"),   # a whole forced answer, or an auto one's calls
    ("length", True, True, "length"),      # parallel calls cut short: the last one is unfinished
    ("stop", True, True, "stop"),          # a forced call cut by a stop string
    ("length", True, False, "tool_calls"),  # auto: a whole call, then text cut short (found in review)
    ("length", False, False, "length"),
    ("stop", False, True, "stop"),
    (None, False, False, "stop"),
])
def test_finish_reason(reason, calls, cut, want):
    from kvfence.server.app import finish_reason

    assert finish_reason(reason, calls, cut) == want
