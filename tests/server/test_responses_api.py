"""OpenAI's Responses API (`POST /v1/responses`) with the official client: the chat path's
answer in the Responses shape (the same greedy tokens and usage), its events in order and
adding up, function tools and their results, structured output through `responses.parse`,
logprobs, what is refused (with the Responses field named), and a stream cut by its client
that gives every page back."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_harness import MODEL, pool_intact, wait_for

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"]}}


def chat_answer(c, system: str | None, user: str, max_tokens: int, **kw):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0, **kw)


def test_a_response_is_the_chat_answer_in_the_responses_shape(server):
    c = server.client("alice")
    r = c.responses.create(model=MODEL, instructions="Answer in one sentence.", input=ASK, max_output_tokens=64,
                           temperature=0)
    want = chat_answer(c, "Answer in one sentence.", ASK, 64)
    assert want.choices[0].finish_reason == "stop"
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.error is None and r.store is False
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == want.choices[0].message.content and "Paris" in r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the fields OpenAI's object always has (found by a client probe)
    assert r.completed_at >= r.created_at and r.output[0].content[0].logprobs == [] and r.top_logprobs is None
    asked = c.responses.create(model=MODEL, input=ASK, max_output_tokens=2, top_logprobs=2,
                               include=["message.output_text.logprobs"])
    assert asked.top_logprobs == 2 and asked.completed_at is None and asked.status == "incomplete"


def test_an_answer_fed_back_reads_as_the_assistant_turn(server):
    """r.output goes back into the next input as is; its output_text (and a refusal) parts are
    an assistant's text, the same prompt as the chat form of the conversation."""
    c = server.client("alice")
    r = c.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0)
    said = r.output_text
    nxt = c.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, *r.output,
                                                 {"role": "user", "content": "And Italy?"}],
                             max_output_tokens=4, temperature=0)
    chat = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": said},
        {"role": "user", "content": "And Italy?"}])
    assert nxt.usage.input_tokens == chat.usage.prompt_tokens and nxt.output_text == chat.choices[0].message.content
    refused = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]
    assert c.responses.create(model=MODEL, input=refused, max_output_tokens=2).status in ("completed", "incomplete")


def test_streamed_events_are_in_order_and_add_up_to_the_response(server):
    c = server.client("alice")
    kw = dict(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with c.responses.stream(**kw) as s:   # the client's own helper checks the events' consistency
        for _ in s:
            pass
        assert s.get_final_response().output_text == text


def test_max_output_tokens_ends_incomplete(server):
    c = server.client("alice")
    kw = dict(model=MODEL, input="Tell me a long story about the sea.", max_output_tokens=5, temperature=0)
    r = c.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert [item.status for item in r.output] == ["incomplete"]     # the cut message item, as OpenAI marks it
    events = list(c.responses.create(stream=True, **kw))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == r.output_text
    assert [item.status for item in last.response.output] == ["incomplete"]
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"]
    yes_no = {"format": {"type": "json_schema", "name": "yes", "schema": {"type": "boolean"}}}   # ends by itself
    whole = c.responses.create(**{**kw, "max_output_tokens": 16, "input": "Is water wet?", "text": yes_no})
    assert whole.status == "completed" and [item.status for item in whole.output] == ["completed"]


def test_a_function_call_and_its_output_round_trip(server):
    c = server.client("alice")
    r = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                           tool_choice="required", parallel_tool_calls=False, max_output_tokens=48, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), {**WEATHER["parameters"], "additionalProperties": False})
    history = [{"role": "user", "content": "What is the weather in Paris?"}, *[o.model_dump() for o in r.output]]
    answered = c.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=24, temperature=0, input=history + [
        {"type": "function_call_output", "call_id": x.call_id, "output": "sunny, 21 C"} for x in calls])
    assert answered.status in ("completed", "incomplete") and answered.output
    bare = c.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=1, input=history[:1])
    assert answered.usage.input_tokens > bare.usage.input_tokens    # the call and its result reached the model


def test_streamed_parallel_calls_end_one_before_the_next_begins(server):
    """Each item is added, filled and done before the next is added, as OpenAI streams them: a
    client that runs a call at its output_item.done used to get every call only at the end
    (found by a probe)."""
    c = server.client("alice")
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=160, temperature=0,
              tool_choice="required")
    every = list(c.responses.create(stream=True, **kw))
    order = [(e.type, e.output_index) for e in every if hasattr(e, "output_index")]
    assert len({i for _, i in order}) >= 2, order          # this prompt makes several calls
    assert [i for _, i in order] == sorted(i for _, i in order), order
    done = [i for t, i in order if t == "response.output_item.done"]
    assert done == sorted(set(done)) == sorted({i for _, i in order}), order
    assert [o.type for o in every[-1].response.output] == ["function_call"] * len(done)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_before_its_name_is_an_incomplete_call_not_text(server, stream):
    """Cut by max_output_tokens inside '[{"name":"get_', the grammar's wrapper used to be the
    answer's output_text (found by a probe): the one function allowed is the call, incomplete."""
    c = server.client("alice")
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=3,
              temperature=0, tool_choice="required")
    if stream:
        r = [e for e in c.responses.create(stream=True, **kw) if e.type == "response.incomplete"][0].response
    else:
        r = c.responses.create(**kw)
    assert r.status == "incomplete" and [(o.type, o.name, o.status) for o in r.output] == [
        ("function_call", "get_weather", "incomplete")], r.output


def test_a_streamed_function_call_arrives_as_argument_deltas(server):
    c = server.client("alice")
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=48,
              temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    whole = [o for o in c.responses.create(**kw).output if o.type == "function_call"]
    events = list(c.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    assert kinds.count("response.function_call_arguments.delta") > 2        # in pieces, as generated
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(d.arguments) for d in done] == [json.loads(w.arguments) for w in whole]
    assert kinds[-1] == "response.completed"


TIME = {"type": "function", "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                       "required": ["zone"], "additionalProperties": False}}


def _created(client, stream: bool, last_event: str, **kw):
    """The Response, created streamed (then its last event must be `last_event`) or not."""
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == last_event
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_tools_hold_the_call_to_the_listed_functions(server, stream):
    """Responses' tool_choice allowed_tools (mode and tools beside type, flat function entries)
    is the chat path's: asked for the weather with both tools declared, only get_time may be
    called. The Response echoes the tool_choice the client sent."""
    c = server.client("alice")
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice=choice,
              max_output_tokens=64, temperature=0)
    r = _created(c, stream, "response.completed", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and all(o.status == "completed" for o in r.output)
    for call in calls:
        assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    assert r.tool_choice.tools == choice["tools"]
    auto = c.responses.create(**{**kw, "tool_choice": {**choice, "mode": "auto"}, "max_output_tokens": 8})
    assert auto.tool_choice.mode == "auto" and all(o.name == "get_time" for o in auto.output
                                                   if o.type == "function_call")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_call_item(server, stream):
    """Cut short, a forced call is still a call (its arguments so far), and the Response says
    which item was being written, unstreamed as streamed: the call item is incomplete. Unstreamed
    it used to be a message item holding the call's JSON text."""
    c = server.client("alice")
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=11,
              temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    r = _created(c, stream, "response.incomplete", **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status, o.name) for o in r.output] == [("function_call", "incomplete", "get_weather")]
    assert r.output[0].arguments.startswith('{"city') and r.output[0].call_id.startswith("call_")
    with pytest.raises(ValueError):
        json.loads(r.output[0].arguments)


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int


def test_parse_into_a_pydantic_model(server):
    c = server.client("bob")
    r = c.responses.parse(model=MODEL, input="Name a colour and a small number.", text_format=Pick,
                          max_output_tokens=40, temperature=0)
    assert isinstance(r.output_parsed, Pick)
    assert r.text.format.type == "json_schema"


def test_logprobs_are_the_chat_paths(server):
    c = server.client("alice")
    r = c.responses.create(model=MODEL, input="Say hi", include=["message.output_text.logprobs"], top_logprobs=2,
                           max_output_tokens=6, temperature=0)
    lps = r.output[0].content[0].logprobs
    want = chat_answer(c, None, "Say hi", 6, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(lps) == len(want) and all(len(x.top_logprobs) == 2 for x in lps)
    assert [x.token for x in lps] == [w.token for w in want]
    assert [x.logprob for x in lps] == pytest.approx([w.logprob for w in want], abs=1e-4)


@pytest.mark.parametrize("extra,param,says", [
    ({"previous_response_id": "resp_abc"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_abc"}, "conversation", "stores no conversations"),
    ({"background": True}, "background", "stream instead"),
    ({"truncation": "auto"}, "truncation", "never drops"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "always", "tools": [
        {"type": "function", "name": "get_weather"}]}}, "tool_choice.mode", "'auto' or 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.tools",
     "non-empty"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "mcp", "server_label": "deepwiki"}]}}, "tool_choice.tools[0].type", "only function tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function"}]}},
     "tool_choice.tools[0].name", "'tool_choice.tools[0]'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get_weather"}, {"type": "function", "name": "nope"}]}},
     "tool_choice.tools[1].name", "'tool_choice.tools[1].name' names function 'nope'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
     "input[0].content[0]", "text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "store to false"),
    # a refusal part is an assistant's (as in chat)
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "input[0].content[0]",
     "text only"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "string or an array"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "call_id"),
    ({"instructions": "be brief", "input": [{"role": "user", "content": "hi"}, {
        "type": "function_call", "call_id": "c1", "name": "f", "arguments": 5}]}, "input[1]", "(JSON text)"),
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"top_logprobs": 3}, "top_logprobs", "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format", "'text.format.schema'"),
    ({"temperature": 9}, "temperature", "temperature"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools[0].parameters", "'tools[0].parameters'"),
    ({"tool_choice": "required", "tools": [{"type": "function", "name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}]},
     "tools[0].parameters", "cannot enforce"),
])
def test_what_is_refused_names_the_responses_field(server, extra, param, says):
    body = {"model": MODEL, "input": "hi", **extra}
    r = httpx.post(server.base_url + "/responses", json=body, headers={"authorization": "Bearer sk-alice-0001"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert not any(f"'{chat}" in err["message"] for chat in ("messages", "max_completion_tokens", "response_format"))
    assert ".function." not in err["message"]


def test_the_key_decides_the_tenant(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(None).responses.create(model=MODEL, input="hi", max_output_tokens=2)
    before = server.metric("kvfence_requests_total", tenant="bob", outcome="stop") + \
        server.metric("kvfence_requests_total", tenant="bob", outcome="length")
    server.client("bob").responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert wait_for(lambda: server.metric("kvfence_requests_total", tenant="bob", outcome="stop") +
                    server.metric("kvfence_requests_total", tenant="bob", outcome="length") == before + 1)


def test_a_stream_its_client_leaves_gives_every_page_back(server):
    base = server.wait_idle()
    body = {"model": MODEL, "input": "Write a very long story about the sea.", "max_output_tokens": 1000,
            "temperature": 0, "stream": True}
    with server.http() as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(40))
    after = server.wait_idle(30)
    assert after["running"] == 0 and after["waiting"] == 0 and pool_intact(after)
    assert after["pages_free"] >= base["pages_free"] - 2


@pytest.mark.parametrize("field,value,instead", [
    ("response_format", {"type": "json_object"}, "text.format"), ("max_tokens", 5, "max_output_tokens"),
    ("messages", [{"role": "user", "content": "hi"}], "input"), ("n", 2, "one answer"),
])
def test_a_chat_completions_field_sent_to_responses_is_a_400_naming_it(server, field, value, instead):
    """Found by a developer walkthrough: a Responses request with chat's response_format got
    free text (the field was dropped). Each chat-only field is a 400 that names it as sent and
    says what a Response takes; values that ask for what a Response does anyway pass."""
    c = server.client("alice")
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body={field: value})
    assert e.value.body["param"] == field and instead in e.value.body["message"], e.value.body
    ok = c.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body={"n": 1, "logprobs": False})
    assert ok.status in ("completed", "incomplete")


def test_responses_errors_name_responses_fields(server):
    """A prompt over the tenant's cap, and one over the context, name input and
    max_output_tokens, not chat's messages and max_tokens (found by a walkthrough)."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client("capped").responses.create(model=MODEL, input="word " * 40, max_output_tokens=4)
    assert e.value.body["param"] == "input" and e.value.body["code"] == "tenant_max_prompt_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        server.client("alice").responses.create(model=MODEL, input="word " * 9000, max_output_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    assert "'max_output_tokens'" in e.value.body["message"] and "'max_tokens'" not in e.value.body["message"]
