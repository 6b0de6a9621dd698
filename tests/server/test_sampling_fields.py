"""OpenAI's presence/frequency penalties and logit_bias, and vLLM's repetition_penalty,
min_p and min_tokens, through the real server and the official client: each changes the
answer the way its definition says, and a wrong value is a 400 naming the field."""
from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest
from server_harness import MODEL


def _complete(client, **kw):
    return client.completions.create(model=MODEL, temperature=0, **kw)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one(server):
    c = server.client("alice")
    enc = server.engine.tokenizer.hf.encode
    forced = _complete(c, prompt="The capital of France is", max_tokens=4, logit_bias={"1234": 100})
    assert set(enc(forced.choices[0].text, add_special_tokens=False).ids) == {1234}, forced.choices[0].text
    # ban the greedy first token: the answer starts differently
    plain = _complete(c, prompt="The capital of France is", max_tokens=4)
    first_id = enc(plain.choices[0].text, add_special_tokens=False).ids[0]
    banned = _complete(c, prompt="The capital of France is", max_tokens=4, logit_bias={str(first_id): -100})
    assert enc(banned.choices[0].text, add_special_tokens=False).ids[0] != first_id


def test_frequency_penalty_repeats_less(server):
    c = server.client("alice")
    prompt = "List the word apple again and again: apple apple apple apple"
    plain = _complete(c, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True})
    pen = _complete(c, prompt=prompt, max_tokens=24, frequency_penalty=2.0, extra_body={"ignore_eos": True})
    enc = server.engine.tokenizer.hf.encode
    most = lambda text: Counter(enc(text, add_special_tokens=False).ids).most_common(1)[0][1]  # noqa: E731
    assert most(pen.choices[0].text) < most(plain.choices[0].text), (plain.choices[0].text, pen.choices[0].text)
    pres = _complete(c, prompt=prompt, max_tokens=24, presence_penalty=2.0, extra_body={"ignore_eos": True})
    assert pres.choices[0].text != plain.choices[0].text
    rep = _complete(c, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert most(rep.choices[0].text) < most(plain.choices[0].text)


def test_min_tokens_holds_back_the_end(server):
    c = server.client("alice")
    msgs = [{"role": "user", "content": "Say hi."}]
    short = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    held = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                     extra_body={"min_tokens": 30})
    assert held.usage.completion_tokens >= 30
    # a stop string counts from the min_tokens-th token on too (it ended the request at once before)
    stopped = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, stop=["!", "."])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 10
    held = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, stop=["!", "."],
                                     extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20


def test_min_p_is_accepted_and_seeded_sampling_stays_reproducible(server):
    c = server.client("alice")
    kw = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, extra_body={"min_p": 0.2})
    a = c.completions.create(model=MODEL, **kw)
    b = c.completions.create(model=MODEL, **kw)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"5": "x"}), ("logit_bias", [1, 2]),
    ("repetition_penalty", 0), ("repetition_penalty", 1e-300), ("min_p", 1.5), ("min_tokens", -1),
])
def test_a_wrong_value_is_a_400_naming_the_field(server, field, value):
    c = server.client("alice")
    body = {field: value} if field in ("presence_penalty", "frequency_penalty", "logit_bias") else {}
    extra = {} if body else {field: value}
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **body, extra_body=extra)
    assert e.value.body["param"] == field, e.value.body


def test_min_tokens_above_max_tokens_is_a_400(server):
    with pytest.raises(openai.BadRequestError, match="min_tokens") as e:
        server.client("alice").completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens"     # found by a walkthrough: it was null
    # in the API's words, the field quoted (it was the engine's "must be in [0, max_tokens], got 5")
    assert "'min_tokens' is 5, more than the 2 tokens the request's 'max_tokens' allows" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:   # the limit by the name the client gave it (review)
        server.client("alice").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_completion_tokens=2, extra_body={"min_tokens": 5})
    assert "'max_completion_tokens' allows" in e.value.body["message"], e.value.body


@pytest.mark.parametrize("extra,param", [
    ({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"user": 5}, "user"), ({"metadata": "x"}, "metadata"),
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    # OpenAI's bounds on what is only echoed (a review found a megabyte of metadata echoed
    # three times a streamed Response)
    ({"metadata": {"k": 5}}, "metadata"), ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"user": "u" * 513}, "user"),
])
def test_values_openai_refuses_are_a_400_naming_the_field(server, extra, param):
    """Found by a developer walkthrough: a stop token id outside the vocabulary (a stop that
    can never apply), a numeric user, a string metadata were taken; include_usage's error
    named 'include_usage' alone."""
    r = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-alice-0001"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text



def test_skip_special_tokens_false_keeps_them_in_the_text(server):
    """vLLM's skip_special_tokens, which SamplingParams and the PD wire carried already but the
    API did not take: false shows the special tokens the model wrote (here forced by
    logit_bias), true (the default) leaves them out."""
    c = server.client("alice")
    special = server.engine.tokenizer.hf.token_to_id("<|im_end|>")
    kw = dict(prompt="Hello", max_tokens=2, logit_bias={str(special): 100})
    kept = _complete(c, **kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_end|><|im_end|>"
    assert _complete(c, **kw, extra_body={"ignore_eos": True}).choices[0].text == ""


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    """vLLM's include_stop_str_in_output, carried by SamplingParams and the PD wire, now taken
    by the API: the answer ends with the stop string instead of before it."""
    c = server.client("alice")
    plain = _complete(c, prompt="Count: 1, 2, 3,", max_tokens=12).choices[0].text
    stop = plain.strip()[:2]
    cut = _complete(c, prompt="Count: 1, 2, 3,", max_tokens=12, stop=[stop])
    kept = _complete(c, prompt="Count: 1, 2, 3,", max_tokens=12, stop=[stop],
                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == "stop" == kept.choices[0].finish_reason
    assert kept.choices[0].text == cut.choices[0].text + stop, (plain, cut.choices[0].text, kept.choices[0].text)


@pytest.mark.parametrize("field,value", [
    ("guided_json", {"type": "object"}), ("guided_choice", ["yes", "no"]), ("guided_regex", "[0-9]+"),
    ("structured_outputs", {"json": {"type": "object"}}), ("regex", "a+"), ("use_beam_search", True),
    ("bad_words", ["x"]), ("chat_template", "{{ messages }}"),
    ("prompt_logprobs", 1), ("truncate_prompt_tokens", 10), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("web_search_options", {}),
    # llama.cpp's and vLLM's, found by a framework probe answering 200 as if they were not there
    ("grammar", 'root ::= "yes"'), ("json_schema", {"type": "object"}), ("n_predict", 5), ("repeat_penalty", 1.3),
    ("typical_p", 0.5), ("mirostat", 2), ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True),
])
def test_another_servers_field_that_would_change_the_answer_is_a_400_saying_what_to_send(server, field, value):
    """A client moved from vLLM or SGLang sending guided_json got free text, silently: such
    fields are refused with what to use instead, on chat, completions and Responses. Values
    that ask for what kvfence does anyway pass. Mutant: no refusal."""
    c = server.client("alice")
    ask = [{"role": "user", "content": "Is water wet?"}]
    calls = [lambda: c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, extra_body={field: value}),
             lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={field: value}),
             lambda: c.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={field: value})]
    said = []
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"], e.value.body
        said.append(e.value.body["message"])
    if field == "guided_json":
        assert "'response_format' of type json_schema" in said[0] and "'text.format' of type json_schema" in said[2]
    harmless = {"use_beam_search": False, "add_generation_prompt": True, "length_penalty": 1.0, "bad_words": [],
                "chat_template_kwargs": {}, "modalities": ["text"], "repeat_penalty": 1.0, "typical_p": 1,
                "mirostat": 0, "return_tokens_as_token_ids": False, field: None}
    r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, temperature=0, extra_body=harmless)
    assert r.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"documents": [{"text": "x"}]}, "documents"),
])
def test_chat_refuses_what_other_servers_chat_does_that_would_change_the_answer(server, extra, param):
    """vLLM's chat echo and documents, best_of beside n: each was answered 200 as if not sent."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-alice-0001"}, json=body,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "not supported" in r.json()["error"]["message"]
    harmless = {"echo": False, "best_of": 1, "messages": [{"role": "assistant", "content": "x", "prefix": False},
                                                          {"role": "user", "content": "hi"}]}
    ok = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-alice-0001"},
                    json={**body, **harmless, "documents": None}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("extra,param", [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"metadata": "x"}, "metadata"),
    ({"user": 5}, "user"),
])
def test_the_responses_echo_is_held_to_the_same_bounds(server, extra, param):
    """The Response object echoes metadata and user in every event; they were taken unchecked."""
    r = httpx.post(server.url + "/v1/responses", headers={"authorization": "Bearer sk-alice-0001"},
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.url + "/v1/responses", headers={"authorization": "Bearer sk-alice-0001"},
                    json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "metadata": {"k": "v"}, "user": "u"},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "v"} and ok.json()["user"] == "u"


ASKED = [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is"}]


@pytest.mark.parametrize("how", ["continue_final_message", "both_fields", "prefix"])
def test_chat_continues_the_last_assistant_message(server, how):
    """vLLM's continue_final_message (with add_generation_prompt false or left out) and
    DeepSeek's and Mistral's "prefix": true on the last message: the answer goes on with the
    assistant's words instead of starting a turn of its own (a framework probe; it was a 400).
    The prompt is the template's text up to the end of that message, left open: the answer is
    the one /v1/completions gives for exactly that text (greedy), streamed or not. Mutant: the
    message closed as the template writes it."""
    c = server.client("alice")
    extra = {"continue_final_message": {"continue_final_message": True},
             "both_fields": {"continue_final_message": True, "add_generation_prompt": False}, "prefix": {}}[how]
    messages = ASKED if how != "prefix" else [ASKED[0], {**ASKED[1], "prefix": True}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    tok = server.state.engine.tokenizer
    open_text = tok.apply_chat_template(ASKED[:1], True) + ASKED[1]["content"]   # ChatML: the turn as begun
    ids = tok.encode_rendered(open_text)
    plain = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text, (chat, plain)
    assert chat.usage.prompt_tokens == len(ids)
    counted = httpx.post(server.url + "/tokenize", headers={"authorization": "Bearer sk-alice-0001"},
                         json={"model": MODEL, "messages": messages, **extra}, timeout=60).json()
    assert counted["tokens"] == ids, counted      # /tokenize counts what generation sends
    assert "Paris" in chat.choices[0].message.content and "capital" not in chat.choices[0].message.content
    streamed = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                         extra_body=extra)
    assert "".join(x.choices[0].delta.content or "" for x in streamed if x.choices) == plain.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True, "messages": ASKED[:1]}, "continue_final_message"),
    ({"messages": [{**ASKED[0], "prefix": True}, ASKED[1]]}, "messages[0].prefix"),
    ({"continue_final_message": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"continue_final_message": True, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools"),
    ({"continue_final_message": True, "messages": [ASKED[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls"),
])
def test_what_cannot_be_continued_is_a_400_saying_why(server, body, param):
    """A new turn and a continuation at once; a last message that is not the assistant's; a
    format or a tool call, which hold an answer from its first character (this one has begun)."""
    r = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-alice-0001"},
                   json={"model": MODEL, "messages": ASKED, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
