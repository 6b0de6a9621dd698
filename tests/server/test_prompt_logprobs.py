"""echo with logprobs, and max_tokens=0: how evaluation harnesses score a prompt (lm-evaluation-
harness's local-completions sends token-id prompts with echo=True, logprobs=1, max_tokens=1;
HELM max_tokens=0), through the server with the official openai client.

The reference for every prompt token's logprob is teacher forcing in a separate request: the
prompt cut just before that token, the token forced with a +100 logit_bias, its reported
logprob (logprobs come from the unbiased logits). Both come from the same float32 LM head; on
the server's bf16 fused kernels the hidden states are bit for bit the same however the rows
are batched (docs/openai-api.md), in float32 within 2e-5: TOL holds for both."""
from __future__ import annotations

import pytest
from server_harness import MODEL

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
TOL = 1e-4


def token_ids(server, text: str) -> list[int]:
    with server.http("alice") as h:
        return h.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]


def score(c, prompt, **kw):
    return c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=kw.pop("logprobs", 1),
                                max_tokens=kw.pop("max_tokens", 0), temperature=0, **kw)


def best_is(lp, i: int) -> bool:
    """Whether the chosen token at i is the likeliest (its entry then has logprobs entries)."""
    return max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]


def test_max_tokens_0_scores_every_prompt_token_as_teacher_forcing_does(server):
    c = server.client("alice")
    ids = token_ids(server, PROMPT)
    r = score(c, PROMPT)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing comes before the first token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == PROMPT
    argmax_seen = 0
    for t in range(1, len(ids)):
        forced = c.completions.create(model=MODEL, prompt=ids[:t], max_tokens=1, temperature=0, logprobs=1,
                                      logit_bias={str(ids[t]): 100})
        f = forced.choices[0].logprobs
        assert forced.choices[0].text == lp.tokens[t]           # the bias did force the prompt's token
        assert abs(f.token_logprobs[0] - lp.token_logprobs[t]) < TOL, t
        # the top alternative is the teacher-forced request's own top-1 (the argmax there); each
        # entry also holds the chosen token (the forced one, the prompt's), so 1 or 2 of them
        assert f.tokens[0] in f.top_logprobs[0] and lp.tokens[t] in lp.top_logprobs[t]
        assert len(f.top_logprobs[0]) == len(lp.top_logprobs[t]) == (1 if best_is(f, 0) else 2), t
        best, best_lp = max(f.top_logprobs[0].items(), key=lambda kv: kv[1])
        top, top_lp = max(lp.top_logprobs[t].items(), key=lambda kv: kv[1])
        assert top == best and abs(top_lp - best_lp) < TOL, t
        if best == lp.tokens[t]:   # the prompt's token is the argmax: its logprob is the top value
            argmax_seen += 1
            assert lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t]
    assert argmax_seen >= 3


def test_generated_tokens_follow_the_prompts_and_are_unchanged(server):
    c = server.client("bob")
    n_prompt = len(token_ids(server, PROMPT))
    r = score(c, PROMPT, logprobs=2, max_tokens=5)
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    ch, p = r.choices[0], plain.choices[0]
    assert ch.text == PROMPT + p.text and r.usage.completion_tokens == 5
    lp = ch.logprobs
    assert len(lp.tokens) == n_prompt + 5
    assert lp.tokens[n_prompt:] == p.logprobs.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(p.logprobs.token_logprobs, abs=TOL)
    assert [set(d) for d in lp.top_logprobs[n_prompt:]] == [set(d) for d in p.logprobs.top_logprobs]
    assert lp.text_offset[n_prompt] == len(PROMPT)   # the generated text starts after the echoed prompt
    # the 2 likeliest, and the chosen token when it is not one of them
    assert all(tok in d and (len(d) == 2 or len(d) == 3 and d[tok] == min(d.values()))
               for tok, d in zip(lp.tokens[1:], lp.top_logprobs[1:]))


def test_a_prompt_longer_than_one_step_and_a_cached_prefix_lose_nothing(server, make_server):
    """Prefill in 16-token chunks on a second server; then the same prompt again, when its
    pages are in the prefix cache: a scoring request skips the cache (a cached position has
    no logits), so it is computed, and scored, in full."""
    long = PROMPT + " Madrid. " + "The capital of Germany is Berlin, of Portugal Lisbon, of Austria Vienna. " * 3
    ids = token_ids(server, long)
    assert len(ids) > 3 * 16
    ref = score(server.client("alice"), ids).choices[0].logprobs
    small = make_server(max_num_batched_tokens=16)
    c = small.client("alice")
    for _ in range(2):
        r = score(c, ids)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(ref.token_logprobs[1:], abs=TOL)
        assert lp.tokens == ref.tokens
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    # a plain request does reuse the pages the scoring requests published
    again = c.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 3 * 16


def test_a_list_of_prompts_and_n_choices_each_carry_their_prompt(server):
    c = server.client("alice")
    other = "One, two, three, four,"
    prompts = [PROMPT, token_ids(server, other)]
    r = score(c, prompts, max_tokens=1)
    alone = [score(c, p, max_tokens=1).choices[0] for p in prompts]
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch, a in zip(r.choices, alone):
        assert ch.text == a.text and ch.logprobs.tokens == a.logprobs.tokens
        assert ch.logprobs.token_logprobs[0] is None
        assert ch.logprobs.token_logprobs[1:] == pytest.approx(a.logprobs.token_logprobs[1:], abs=TOL)
    assert r.choices[1].text.startswith(other)
    # n=2: the second choice attaches the first one's cached pages, and carries the same prompt logprobs
    two = score(c, PROMPT, max_tokens=2, n=2, seed=5)
    assert two.choices[0].logprobs.tokens[:-2] == two.choices[1].logprobs.tokens[:-2] == alone[0].logprobs.tokens[:-1]
    assert two.choices[1].logprobs.token_logprobs[:-2] == two.choices[0].logprobs.token_logprobs[:-2]


def test_streamed_echo_with_logprobs_is_the_whole_answer_in_pieces(server):
    c = server.client("alice")
    whole = score(c, PROMPT, max_tokens=4).choices[0]
    tokens, values, text = [], [], ""
    for chunk in score(c, PROMPT, max_tokens=4, stream=True):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOL)


def test_echo_with_max_tokens_0_and_no_logprobs_returns_the_prompt(server):
    c = server.client("alice")
    r = c.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 0
    snap = server.wait_idle()
    assert snap["pages_owned"] == 0


def test_an_answer_with_too_many_prompt_logprob_entries_is_a_400_naming_logprobs(server, monkeypatch):
    """The entries an answer would carry (prompt tokens x (logprobs + 1) x n) are bounded
    before anything runs: every one is a Python object and then JSON."""
    import openai

    from kvfence.server import app as app_module

    c = server.client("alice")
    n_tokens = len(c.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
                   .choices[0].logprobs.tokens)
    monkeypatch.setattr(app_module, "MAX_LOGPROB_ENTRIES", n_tokens * 3 * 2)
    ok = c.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, n=2)
    assert len(ok.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, n=3)
    assert e.value.body["param"] == "logprobs" and "logprob entries" in e.value.body["message"]
    assert server.wait_idle()["pages_owned"] == 0
