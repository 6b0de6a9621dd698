"""An auto tool answer's text is streamed until a <tool_call> tag begins (TextBeforeCalls);
what was streamed plus what is sent at the end is exactly the unstreamed content, however the
text was cut into deltas, and nothing of a tag is ever streamed as text."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfence.server.tools import TextBeforeCalls, parse_answer, parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PIECES = ["Sure", " ", "\n", "<", "<tool", "_call>", "<tool_call>", CALL, CALL[:30], "</tool_call>", "ok.", "<b>"]


def _streamed(deltas: list[str]) -> tuple[str, str, str | None, list | None]:
    spec = parse_tools({"tools": TOOLS})
    t = TextBeforeCalls()
    streamed = "".join(t.feed(d) for d in deltas)
    content, calls = parse_answer("".join(deltas), spec)
    return streamed, t.rest(content), content, calls


@given(st.lists(st.sampled_from(PIECES), max_size=12), st.data())
def test_streamed_and_sent_at_the_end_add_up_to_the_content(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed, rest, content, _ = _streamed(deltas)
    assert streamed + rest == (content or "")
    tag = text.find("<tool_call>")
    assert text.startswith(streamed) and (tag < 0 or len(streamed) <= tag)   # nothing of a tag


def test_text_goes_out_as_it_comes_and_stops_at_the_tag():
    t = TextBeforeCalls()
    assert [t.feed(d) for d in ["Let me", " check", " <tool", "_call>", '{"name"']] == ["Let me", " check", "", "", ""]
    streamed, rest, content, calls = _streamed(["Let me check. ", CALL])
    assert (streamed, rest, content) == ("Let me check.", "", "Let me check.") and calls
    assert _streamed(["\n", CALL, "\nDone."])[1:3] == ("Done.", "Done.")     # only whitespace before the call
    assert _streamed(["a <tool", " b"])[0] == "a <tool b"                  # not a tag after all
