"""A maximal body is parsed off the event loop: while the most token ids a body may hold are
decoded and checked, /health/live and other requests keep being answered (no timing
threshold: the check is that the event loop answered polls while the big request was in
progress), and the big request is refused as over-length before any per-id work. A body of
more values than any request needs (~4 M ids) is refused before it is parsed at all."""
from __future__ import annotations

import json
import threading

import httpx
import pytest


def _spy_on(threads: dict[str, threading.Thread]):
    """spy(name, fn): fn, recording in `threads` which thread ran it under `name`."""
    def spy(name, fn):
        def wrapped(*a, **kw):
            threads[name] = threading.current_thread()
            return fn(*a, **kw)
        return wrapped
    return spy


@pytest.fixture(scope="module")
def big_server(make_server):
    return make_server(tenants=None, max_body_bytes=16 << 20)


def test_a_maximal_token_id_body_does_not_stall_the_event_loop(big_server, monkeypatch):
    import kvfence.server.app as app
    import kvfence.server.protocol as protocol

    threads: dict[str, threading.Thread] = {}   # where the JSON and the request fields were parsed

    spy = _spy_on(threads)
    monkeypatch.setattr(protocol, "parse_json_body", spy("json", protocol.parse_json_body))
    monkeypatch.setattr(app, "parse_completion", spy("fields", app.parse_completion))
    from kvfence.server.protocol import MAX_JSON_ITEMS

    raw = json.dumps({"prompt": [49151] * (MAX_JSON_ITEMS - 2), "max_tokens": 1}).encode()
    assert len(raw) > 1 << 20
    done, result = threading.Event(), {}

    def big():
        r = httpx.post(big_server.url + "/v1/completions", content=raw, timeout=120,
                       headers={"content-type": "application/json"})
        result["r"] = r
        done.set()
    t = threading.Thread(target=big)
    with httpx.Client(timeout=30) as c:
        t.start()
        polls = 0
        while not done.is_set():
            assert c.get(big_server.url + "/health/live").status_code == 200
            polls += 1
    t.join(60)
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert polls >= 1, f"only {polls} health polls were answered while the big body was in progress"
    # both passes over the ids ran in a worker thread, not on the server's event loop thread
    assert set(threads) == {"json", "fields"}
    assert all(t is not big_server.thread for t in threads.values()), threads
    # ~4 M ids (8 MiB): refused by the values bound, off the loop, before json.loads or any field
    threads.clear()
    r = httpx.post(big_server.url + "/v1/completions", content=json.dumps({"prompt": [1] * 4_000_000}).encode(),
                   timeout=120, headers={"content-type": "application/json"})
    assert r.status_code == 400 and f"more than {MAX_JSON_ITEMS} values" in r.json()["error"]["message"]
    assert set(threads) == {"json"} and threads["json"] is not big_server.thread   # no field was read


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "echo": True, "logprobs": 2, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}),
])
def test_an_answer_is_built_off_the_event_loop_and_encoded_in_slices(big_server, monkeypatch, route, body):
    """An answer with ~1M logprob entries (echo, logprobs, n=11 over 4000 prompt tokens: an
    attacker probe) took ~0.6 s to build and 1.3-2.4 s to encode as JSON; on the event loop that
    paused every other tenant's stream and /health/live. It is built in a worker thread and
    encoded by json_slices (the loop runs between slices: tests/unit/test_json_slices.py; in a
    thread the C encoder held the GIL throughout, found in review)."""
    import kvfence.server.app as app
    from kvfence.server.openai_format import Formatter

    threads: dict[str, threading.Thread] = {}

    spy = _spy_on(threads)
    monkeypatch.setattr(Formatter, "response", spy("build", Formatter.response))
    monkeypatch.setattr(app, "encode_json", spy("encode", app.encode_json))
    monkeypatch.setattr(app, "INLINE_ANSWER_ENTRIES", -1)   # a small answer stands for a large one here
    r = httpx.post(big_server.url + route, json={"model": "SmolLM2-135M-Instruct", **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert set(threads) == {"build", "encode"}
    # in the answers' own pool, not the default one that tokenizing and body parsing share
    assert threads["build"].name.startswith("kvfence-answer"), threads


def test_a_streamed_echo_with_logprobs_is_built_off_the_event_loop(big_server, monkeypatch):
    """The streamed form of the answer above: each choice's first chunk carries the prompt's
    logprobs (~3K prompt tokens x 20 top entries held the loop ~90 ms a choice, n=16 a
    request, found in review). It is built in the answers' pool and encoded in slices."""
    import kvfence.server.app as app
    from kvfence.server.openai_format import Formatter

    threads: dict[str, threading.Thread] = {}
    spy = _spy_on(threads)
    monkeypatch.setattr(Formatter, "prompt_logprobs", spy("build", Formatter.prompt_logprobs))
    monkeypatch.setattr(app, "encode_json", spy("encode", app.encode_json))
    monkeypatch.setattr(app, "INLINE_ANSWER_ENTRIES", -1)   # a small answer stands for a large one here
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there", "max_tokens": 2, "echo": True, "logprobs": 2,
            "n": 2, "stream": True}
    with httpx.stream("POST", big_server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    first = [json.loads(e[6:]) for e in events[:-1]]
    echoed = [c for e in first for c in e["choices"] if c["text"].startswith("Hello there")]
    assert len(echoed) == 2 and all(c["logprobs"]["tokens"] for c in echoed)
    assert set(threads) == {"build", "encode"}
    assert threads["build"].name.startswith("kvfence-answer"), threads


def test_a_long_tool_answer_is_parsed_off_the_event_loop(big_server, monkeypatch):
    """Found in review: an answer without logprobs counted as free to build, so a tool answer
    was parsed for calls on the loop however long its text (~0.2 us a character, 16 choices
    of 8K tokens ~100 ms). Its text now counts: with the inline bound lowered to stand for a
    long answer, the tool answer is parsed in the answers' pool and the same answer without
    tools is still built on the loop."""
    import kvfence.server.app as app

    threads: dict[str, threading.Thread] = {}
    spy = _spy_on(threads)
    monkeypatch.setattr(app, "parse_answer", spy("parse", app.parse_answer))
    monkeypatch.setattr(app.Formatter, "response", spy("build", app.Formatter.response))
    monkeypatch.setattr(app, "INLINE_ANSWER_ENTRIES", 8)   # 16 characters of text
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 24, "temperature": 0}
    plain = httpx.post(big_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert plain.status_code == 200 and len(plain.json()["choices"][0]["message"]["content"]) > 16, plain.text
    assert threads["build"] is big_server.thread   # no logprobs, no tools: cheap, built inline
    threads.clear()
    r = httpx.post(big_server.url + "/v1/chat/completions", json={**body, "tools": [tool]}, timeout=60)
    assert r.status_code == 200, r.text
    assert threads["parse"].name.startswith("kvfence-answer"), threads
