"""n choices, best_of, lists of prompts and echo, through the server with the official openai
client (sync, async, streaming). The choices of one prompt share its full KV pages: the
first choice runs the prefill, the others attach its pages from the tenant's prefix cache
(read-only SHARED pages; the ledger refuses a write into one: tests/unit/test_ledger.py
test_shared_pages_are_read_only_scoped_and_refcounted, and for n choices on the real model with
a mutant, tests/isolation/test_shared_prompt_pages.py) and compute only the partial page."""
from __future__ import annotations

import asyncio

from server_harness import MODEL

LONG = "The history of the printing press begins with movable type in East Asia. " * 6


def test_n_choices_have_their_own_seed_streams_and_count_the_prompt_once(server):
    c = server.client("alice")
    kw = dict(model=MODEL, prompt=LONG, max_tokens=12, temperature=1.0, seed=1234)
    hits = server.metric("kvfence_prefix_cache_hit_tokens_total")
    r = c.completions.create(n=3, **kw)
    hits = server.metric("kvfence_prefix_cache_hit_tokens_total") - hits
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.text for ch in r.choices]
    assert len(set(texts)) == 3                              # distinct seeded texts
    one = c.completions.create(**kw)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(1 for _ in range(3)) * 12
    # choice j is seed + j: the same text a single request with that seed gets
    for j in range(3):
        alone = c.completions.create(**{**kw, "seed": 1234 + j}).choices[0].text
        assert alone == texts[j]
    # the other choices attached the first one's full pages (16 tokens each) instead of computing
    # them; usage counts the prompt once, and its cached tokens with it (OpenAI's never exceed
    # prompt_tokens: before, every choice's attached pages were added up, 2x the prompt here)
    full = (r.usage.prompt_tokens - 1) // 16 * 16
    assert hits >= 2 * full > 0
    assert r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens


def test_greedy_choices_equal_the_single_answer(server):
    c = server.client("bob")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
              temperature=0)
    one = c.chat.completions.create(**kw).choices[0].message.content
    r = c.chat.completions.create(n=2, **kw)
    assert [ch.message.content for ch in r.choices] == [one, one]
    assert [ch.index for ch in r.choices] == [0, 1]


def test_streamed_choices_carry_their_index_and_finish_each(server):
    c = server.client("alice")
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                       max_tokens=10, temperature=1.0, seed=7, n=2, stream=True,
                                       stream_options={"include_usage": True})
    text = {0: "", 1: ""}
    finished, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert set(finished) == {0, 1} and all(text.values())
    assert usage is not None and usage.completion_tokens == 20
    whole = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                      max_tokens=10, temperature=1.0, seed=7, n=2)
    assert [ch.message.content for ch in whole.choices] == [text[0], text[1]]


def test_a_list_of_prompts_is_answered_in_order(server):
    c = server.client("alice")
    prompts = ["The capital of France is", "One, two, three,", [504, 3575, 314]]
    r = c.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    r2 = c.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in r2.choices] == [0, 1, 2, 3]
    assert r2.choices[0].text == r2.choices[1].text == alone[0].choices[0].text[:len(r2.choices[0].text)]


def test_echo_puts_the_prompt_before_each_choice(server):
    c = server.client("alice")
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                             echo=True)
    plain = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text == "The capital of France is" + plain.choices[0].text
    chunks = list(c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=2, n=2).choices[1].index == 1


def test_async_client_n_choices(server):
    async def go():
        c = server.async_client("bob")
        r = await c.completions.create(model=MODEL, prompt=LONG, max_tokens=5, temperature=0.8, seed=3, n=2)
        return [ch.text for ch in r.choices]
    texts = asyncio.run(go())
    assert len(texts) == 2 and all(texts)


def test_nothing_is_left_behind(server):
    snap = server.wait_idle()
    assert snap["running"] == 0 and snap["waiting"] == 0 and snap["pages_owned"] == 0


def test_fields_that_change_nothing_are_accepted_and_ignored(server):
    c = server.client("alice")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    same = c.chat.completions.create(**kw, user="user-1234", metadata={"k": "v"}, store=False,
                                     service_tier="auto", parallel_tool_calls=True).choices[0].message.content
    assert same == plain


def test_without_the_prefix_cache_every_choice_computes_its_prompt(make_server):
    # `--no-prefix-cache` (docs/openai-api.md named the flag before it existed) reaches the engine
    from kvfence.cli import _config, build_parser

    a = build_parser().parse_args(["serve", "--no-prefix-cache"])
    assert _config(a).enable_prefix_cache is False
    assert _config(build_parser().parse_args(["serve"])).enable_prefix_cache is True
    s = make_server(tenants=None, enable_prefix_cache=False)
    c = s.client()
    kw = dict(model=MODEL, prompt=LONG, max_tokens=8, temperature=1.0, seed=99)
    r = c.completions.create(n=2, **kw)
    r2 = c.completions.create(n=2, **kw)   # the same prompt again: nothing kept from the first
    for j in range(2):
        assert c.completions.create(**{**kw, "seed": 99 + j}).choices[0].text == r.choices[j].text
    assert [ch.text for ch in r2.choices] == [ch.text for ch in r.choices]
    assert r2.usage.prompt_tokens_details is None or not r2.usage.prompt_tokens_details.cached_tokens
    assert s.metric("kvfence_prefix_cache_hit_tokens_total") == 0
