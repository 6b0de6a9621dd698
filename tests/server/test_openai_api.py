"""The OpenAI API through the official `openai` client (sync, async, streaming) against a
real uvicorn server: completions, chat, streaming, usage, sampling options, logprobs."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
from server_harness import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok(loaded_fp32):
    return loaded_fp32.tokenizer


def test_models_lists_the_served_model_with_its_context(server):
    models = server.client().models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    card = server.client().models.retrieve(MODEL)
    assert card.id == MODEL
    assert card.model_extra["max_model_len"] == server.engine.facts["usable_context"] == 1440
    assert card.model_extra["max_choices"] == 16     # prompts x n: the protocol's bound at --max-waiting 1024


def test_completion_text_usage_and_finish_reason(server, tok):
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    ch = r.choices[0]
    assert ch.finish_reason == "length"
    assert "Paris" in ch.text                      # the model knows this one
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_accepts_token_ids(server, tok):
    ids = tok.encode(PROMPT)
    by_ids = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_uses_the_chat_template(server, tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0].message
    assert m.role == "assistant" and "Paris" in m.content
    assert r.usage.prompt_tokens == len(tok.encode_chat(msgs))
    n = r.usage.completion_tokens
    assert 0 < n <= 12 and (n == 12) == (r.choices[0].finish_reason == "length")


def test_an_empty_user_message_is_answered(server, tok):
    """OpenAI and vLLM answer it (the chat template still makes a prompt); kvfence refused
    "Every message is empty." (found by the parity probe)."""
    msgs = [{"role": "user", "content": ""}]
    r = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode_chat(msgs)) > 0 and r.choices[0].finish_reason


def test_streaming_equals_non_streaming_for_greedy(server):
    c = server.client()
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text and len(text) > 0
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == full.usage.completion_tokens
    assert usage[0].prompt_tokens == full.usage.prompt_tokens
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert len({ch.id for ch in chunks}) == 1


def test_chat_streaming_equals_non_streaming_and_usage_only_when_asked(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks)     # include_usage not asked for


def test_a_chat_answer_has_the_fields_openais_always_has(server):
    """Read as raw JSON, as clients outside Python read it: refusal null on the message and on
    the first delta, and usage's completion_tokens_details (found by a client probe)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json=body).json()
        first = next(line for line in h.post("/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
                     if line.startswith("data: {"))
    assert r["choices"][0]["message"]["refusal"] is None and "refusal" in r["choices"][0]["message"]
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    delta = json.loads(first[len("data: "):])["choices"][0]["delta"]
    assert delta["role"] == "assistant" and "refusal" in delta and delta["refusal"] is None


def test_stop_string_ends_the_completion(server):
    c = server.client()
    free = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert "." in free
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(".")]


def test_seed_reproduces_and_top_p_tiny_is_greedy(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.2)
    a = c.completions.create(seed=7, **kw).choices[0].text
    b = c.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    others = {c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1
    greedy = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    for top_p in (1e-6, 0):  # 0 is accepted, as OpenAI does: only the most likely token
        nucleus = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                       top_p=top_p, seed=5)
        assert nucleus.choices[0].text == greedy.choices[0].text


def test_max_completion_tokens_wins_over_max_tokens(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}], max_tokens=9,
        max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_logprobs(server):
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and chosen <= 0
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)   # greedy picks the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_streamed_and_not(server):
    c = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 and e.top_logprobs[0].token == e.token for e in content)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None   # no token yet
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in content]


def test_async_client_concurrent_requests_match_sequential(server):
    prompts = ["The capital of France is", "Water is made of", "The largest planet is"]
    sync = [server.client().completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts]

    async def go():
        client = server.async_client()
        async with client:
            return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                                     temperature=0) for p in prompts))

    results = asyncio.run(go())
    assert [r.choices[0].text for r in results] == sync


def test_async_streaming_chat(server):
    async def go():
        client = server.async_client("bob")
        async with client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0,
                stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            async for ch in stream:
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                if ch.usage:
                    usage = ch.usage
            return "".join(parts), usage

    text, usage = asyncio.run(go())
    assert text and usage is not None and usage.completion_tokens <= 6 and usage.prompt_tokens > 10
