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
