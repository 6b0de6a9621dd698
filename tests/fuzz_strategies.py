"""Hypothesis strategies for OpenAI-shaped request bodies, keys and headers, and the shape
checks every answer must pass: shared by the single-node fuzz (tests/server/test_http_fuzz.py)
and the PD cluster's (tests/pd/test_cluster_internal_fuzz.py), so both fuzz the same inputs."""
from __future__ import annotations

import functools
import json
import os

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

VOCAB = 49152  # SmolLM2
MODEL = "SmolLM2-135M-Instruct"
# keys of tests/server/server_harness.py's tenants file (a server without one takes any key)
KEYS = {"alice": "sk-alice-0001", "bob": "sk-bob-00000001"}


def fuzz_settings(default_examples: int) -> settings:
    """Hypothesis settings for a fuzz test: KVFENCE_FUZZ_EXAMPLES examples per route (else the
    default), no deadline and no example database; derandomized in CI so a failure reproduces."""
    examples = int(os.environ.get("KVFENCE_FUZZ_EXAMPLES", str(default_examples)))
    return settings(max_examples=examples, deadline=None, database=None, derandomize=bool(os.environ.get("CI")),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- strategies ------------------------------------------------------------------------------

# Subnormal floats come from a fixed list (_float_edge): the engine flushes denormals to zero
# (torch.set_flush_denormal), and hypothesis refuses to generate them in a process where an
# engine was built on the main thread, as in a whole-suite run.
_floats = functools.partial(st.floats, allow_subnormal=False)

# any code point, lone UTF-16 surrogates (which JSON can escape on their own) made likely, and
# strings that mean something to a tokenizer or a chat template
_char = (st.characters(codec=None, exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
         | st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "\ufeff", "\U0001f600", "<|im_end|>",
                           "<|im_start|>", "{{", "{%"]))
_text = st.lists(_char, max_size=12).map("".join)
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | _floats(allow_nan=True, allow_infinity=True)
            | _text)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3),
                     max_leaves=8)
_int_edge = st.sampled_from([0, 1, -1, 2, 16, 95, 96, 97, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                             -2**63, -2**63 - 1, VOCAB - 1, VOCAB, 10**30])
_float_edge = st.sampled_from([5e-324, 1e-310, -0.0, 1e-300, 1e-5, 0.999999, 1.0000001, 2.0000001, 1e308])
_num = st.integers(-3, 40) | _int_edge | _float_edge | _floats(-5, 5) | _floats(allow_nan=True, allow_infinity=True)
_token_ids = st.lists(st.integers(-2, VOCAB + 2) | _int_edge, min_size=0, max_size=12)
_prompt = (st.text(max_size=60) | _text | _token_ids | st.lists(st.text(max_size=10), max_size=3)
           | st.lists(_token_ids, max_size=2) | _json)
_roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER"]) | _text
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]) | _text,
                               "text": st.text(max_size=20) | _json})
_message = st.fixed_dictionaries({"role": _roles}, optional={
    "content": st.text(max_size=60) | _text | st.lists(_part, max_size=3) | _json,
    "name": _text, "tool_calls": _json})
_messages = st.lists(_message, max_size=4) | _json
_stop = st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=20) | _json
_common = {
    "model": st.just(MODEL) | _text | _json,
    "max_tokens": st.integers(-2, 8) | _int_edge | _json,
    "temperature": _num | _json, "top_p": _num | _json, "top_k": _num | _json,
    "seed": st.integers(-2**64, 2**65) | _int_edge | _json,
    "stop": _stop, "stop_token_ids": _token_ids | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "n": _num | _json, "ignore_eos": st.booleans() | _json,
    "frequency_penalty": _num, "presence_penalty": _num,
    "logit_bias": st.dictionaries(st.text(max_size=5), _num, max_size=2) | _json,
    "user": _text, "__proto__": _json, "": _json,
}
_completion_body = st.fixed_dictionaries({}, optional={
    **_common, "prompt": _prompt, "echo": st.booleans() | _json, "suffix": _text | _json,
    "best_of": _num | _json, "logprobs": _num | _json})
_chat_body = st.fixed_dictionaries({}, optional={
    **_common, "messages": _messages, "max_completion_tokens": st.integers(-2, 8) | _int_edge | _json,
    "logprobs": st.booleans() | _json, "top_logprobs": _num | _json, "tools": _json, "functions": _json,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"]) | _text}) | _json})
# mostly near-valid bodies, so requests get past the first checks and reach the engine
_valid_completion = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40) | _text, "max_tokens": st.integers(1, 6)},
    optional={"temperature": _floats(0, 2), "top_p": _floats(0.01, 1), "top_k": st.integers(-1, VOCAB + 5),
              "seed": st.integers(-2**63, 2**64 - 1), "stream": st.booleans(), "logprobs": st.integers(0, 20),
              "stop": st.lists(st.text(min_size=1, max_size=4) | _text, max_size=3), "ignore_eos": st.booleans(),
              "model": st.just(MODEL)})
_valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=30) | _text}), min_size=1, max_size=3),
     "max_tokens": st.integers(1, 6)},
    optional={"temperature": _floats(0, 2), "stream": st.booleans(), "logprobs": st.booleans(),
              "top_logprobs": st.integers(0, 20), "seed": st.integers(0, 2**64 - 1)})


def _mix(base, extra):
    """A body with some fields replaced by anything."""
    return st.tuples(base, st.dictionaries(st.sampled_from(sorted(_common)) | _text, _json, max_size=2)).map(
        lambda t: {**t[0], **t[1]})


@st.composite
def payload(draw, endpoint: str) -> bytes:
    kind = draw(st.sampled_from(["valid", "valid", "mixed", "fields", "json", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=64) | st.sampled_from([b"", b"{", b"{}", b"[]", b"null", b'{"a":1',
                                                               b"\xff\xfe{}", b'{"prompt": NaN}', b"[" * 5000]))
    if kind == "json":
        body = draw(_json)
    else:
        valid = _valid_chat if endpoint == "chat" else _valid_completion
        fields = _chat_body if endpoint == "chat" else _completion_body
        body = draw({"valid": valid, "mixed": _mix(valid, _json), "fields": fields}[kind])
    text = json.dumps(body, allow_nan=True, ensure_ascii=draw(st.sampled_from([True, True, True, False])))
    return text.encode("utf-8", "surrogatepass")  # lone surrogates become invalid UTF-8 when not escaped


# mostly a valid key, so most requests get past authentication
auth = st.integers(0, 9).flatmap(lambda i: st.sampled_from([f"Bearer {KEYS['alice']}", f"Bearer {KEYS['bob']}"])
                                  if i < 7 else st.one_of(
    st.none(), st.sampled_from(["Bearer", "Bearer ", "Basic abc", f"bearer {KEYS['alice']}", "Bearer sk-\u00e9"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)))
extra_headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Accept", "Accept-Encoding", "X-Request-Id", "OpenAI-Organization",
                     "X-Forwarded-For", "Transfer-Encoding-Ish", "Expect-Nothing"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30), max_size=3)


def wire(headers: dict) -> dict:
    """As a client can put them on the wire: raw UTF-8 bytes, no surrounding whitespace."""
    return {k: v.strip().encode("utf-8") for k, v in headers.items()}


# -- properties ------------------------------------------------------------------------------

def assert_openai_error(r: httpx.Response) -> None:
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def assert_completion(r: httpx.Response, endpoint: str) -> None:
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        finishes = []
        for e in events[:-1]:
            obj = json.loads(e)
            assert "error" not in obj, obj
            assert obj["object"] == ("chat.completion.chunk" if endpoint == "chat" else "text_completion")
            finishes += [c["finish_reason"] for c in obj["choices"] if c["finish_reason"]]
        # one finish per choice (n, lists of prompts), each a normal one
        assert finishes and set(finishes) <= {"stop", "length", "tool_calls"}, finishes
        return
    obj = r.json()
    assert obj["object"] == ("chat.completion" if endpoint == "chat" else "text_completion"), obj
    assert obj["choices"] and [c["index"] for c in obj["choices"]] == list(range(len(obj["choices"])))
    assert all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in obj["choices"]), obj
    u = obj["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] >= 1
