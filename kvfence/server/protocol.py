"""Request bodies of the OpenAI API -> one validated `GenerationRequest`.

Validation is explicit and strict (a bool is not a number, a string is not a list) so
every malformed body gets a 400 that names the offending parameter. Unknown fields are
ignored, as OpenAI-compatible servers do; fields that would change the output but are
not supported are refused rather than silently dropped. Nothing a client sends can
choose the tenant: that comes from the API key only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from starlette.requests import ClientDisconnect

from kvfence.engine.params import (
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_ID,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    canonical_schema,
)
from kvfence.engine.schema_leniency import held_as
from kvfence.server import legacy_functions
from kvfence.server.errors import JSON_ERRORS, APIError, bad_request
from kvfence.server.tools import ToolSpec, call_or_answer_schema, call_schema, parse_tools

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16      # prompts x n in one request: each is a sequence in the engine
MAX_TOKENS_CAP = 2**31 - 1
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenerationRequest:
    kind: str                         # "completion" | "chat"
    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    prompt_text: str | None = None    # completions with a text prompt
    prompt_ids: list[int] | None = None  # completions with token ids
    messages: list[dict] | None = None   # chat, content flattened to text
    logprobs: int | None = None       # top alternatives per token; None: no logprobs
    prompt_param: str = "prompt"      # the parameter a prompt-size error points at
    max_tokens_param: str = "max_tokens"   # the name the client gave its completion limit
    n: int = 1                        # choices per prompt
    more_prompts: list[tuple[str | None, list[int] | None]] | None = None   # completions: prompts after the first
    echo: bool = False                # completions: the prompt's text before each choice's
    tools: ToolSpec | None = None     # chat: tools, tool_choice, parallel_tool_calls
    legacy_functions: bool = False    # chat: sent as `functions`; answered as `function_call`
    continue_final: bool = False      # chat: the answer goes on with the last (assistant) message

    @property
    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        return [(self.prompt_text, self.prompt_ids)] + list(self.more_prompts or ())


# -- body -> JSON ------------------------------------------------------------------------

async def read_body_bytes(request, limit: int) -> bytes:
    """The raw request body, or a 413 as soon as it passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise _too_large(limit)
        except ValueError:
            raise bad_request("Content-Length is not a number.") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # the client hung up, or its body was too slow (the server closed it); nobody reads this
        # not the client's malformed request: counted as it is, a client that left (nginx's 499)
        raise APIError(499, "The connection closed before the request body was complete.", code="client_disconnected",
                       outcome="client_disconnected") from None
    return b"".join(chunks)


# a body larger than this is decoded and checked in a worker thread: parsing 8 MiB of token
# ids took ~2.5 s, during which every stream and /health/live on the event loop stalled
OFF_LOOP_BYTES = 64 << 10


async def read_json_body(request, limit: int, before_parse: Callable[[], None] | None = None) -> dict:
    """The request body as a JSON object, or a 400/413 that says what is wrong with it.
    `before_parse` runs once the bytes are in, before any parsing (it may raise)."""
    raw = await read_body_bytes(request, limit)
    request.state.body_bytes = len(raw)   # what the route's own checks of it may cost (app.py)
    if before_parse is not None:
        before_parse()
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


# json.loads holds the GIL from start to end, whatever thread runs it, and so does every walk
# of what it built: while it runs the engine thread computes nothing. An 8 MiB body of small
# arrays ([[1],[1],...], 2M of them) stopped every stream for ~0.6 s a request; a tenant's
# refused bodies of 760K logit_bias keys, 4M integers or 1.6M short strings (each walked for
# surrogates) slowed another tenant's stream 8-19x (a side-channel probe). No request of ours
# needs more than these; each bound keeps one parse and walk to tens of milliseconds
MAX_JSON_CONTAINERS = 1 << 18   # objects and arrays
MAX_JSON_MEMBERS = 1 << 16      # keys of objects (logit_bias takes 1024, 64 tools' schemas a few thousand)
MAX_JSON_ITEMS = 1 << 20        # values in objects and arrays (/detokenize's 1M ids; a 1M-integer parse: ~70 ms)
MAX_JSON_STRINGS = 1 << 17      # strings, keys included
MAX_JSON_FLOATS = 1 << 14       # numbers with a fraction or exponent: 4x an integer's parse (logit_bias takes 1024)
# the chat template renders every message in Python, holding the GIL too (250K one-letter
# messages took ~1.6 s before they were refused as too long); no conversation needs more
MAX_MESSAGES = 8192


@dataclass(frozen=True)
class JsonShape:
    """What the parser would build from a JSON text, counted outside its strings."""
    containers: int   # objects and arrays
    members: int      # ':' separators: keys of objects
    items: int        # ',' separators: values after the first of each object or array
    strings: int      # string literals, keys included
    floats: int       # '.', and 'e' or 'E' after a digit: at least one per number with a fraction or exponent


def json_shape(raw: bytes) -> JsonShape:
    """Counts of the JSON text's objects and arrays, keys, items and strings. A few vectorised
    passes (~50 ms for 8 MiB): a Python loop over the strings cost ~1 s of CPU for a body of
    millions of short strings holding brackets. Exact for valid JSON; invalid JSON is the
    parser's to refuse, whatever this returns."""
    # Drop escape pairs left to right, as the JSON reader pairs them: each remaining '"'
    # then opens or closes a string, and a byte is outside when an even number precede it
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    containers = members = items = floats = 0
    carry, last = False, 0
    for at in range(0, len(plain), _SCAN_CHUNK):   # a chunk at a time: ~7 bytes of arrays per byte
        byte = np.frombuffer(plain, np.uint8, count=min(_SCAN_CHUNK, len(plain) - at), offset=at)
        inside = np.bitwise_xor.accumulate(byte == 0x22)
        if carry:
            inside = ~inside
        outside = ~inside
        opens = (byte | 0x20) == 0x7B    # '[' (0x5B) and '{' (0x7B), the only bytes that map there
        containers += int(np.count_nonzero(opens & outside))
        members += int(np.count_nonzero((byte == 0x3A) & outside))
        items += int(np.count_nonzero((byte == 0x2C) & outside))
        before = np.concatenate(([last], byte[:-1]))
        exponent = ((byte | 0x20) == 0x65) & (before >= 0x30) & (before <= 0x39)   # e/E after a digit
        floats += int(np.count_nonzero(((byte == 0x2E) | exponent) & outside))
        carry, last = bool(inside[-1]), int(byte[-1])
    return JsonShape(containers, members, items, plain.count(b'"') // 2, floats)


_SCAN_CHUNK = 1 << 20


def _refuse_too_many_values(raw: bytes) -> None:
    """Each bound, checked first by a plain count of its byte (a few ms), then exactly outside
    strings only when that plain count is over it (braces, colons, commas and quotes in text are fine)."""
    quick = (raw.count(b"{") + raw.count(b"["), raw.count(b":"), raw.count(b",") + 1, raw.count(b'"') // 2,
             raw.count(b".") + raw.count(b"e") + raw.count(b"E"))
    bounds = (MAX_JSON_CONTAINERS, MAX_JSON_MEMBERS, MAX_JSON_ITEMS, MAX_JSON_STRINGS, MAX_JSON_FLOATS)
    if all(q <= b for q, b in zip(quick, bounds, strict=True)):
        return
    shape = json_shape(raw)
    for count, bound, what in ((shape.containers, MAX_JSON_CONTAINERS, "JSON objects and arrays"),
                               (shape.members, MAX_JSON_MEMBERS, "object keys"),
                               (shape.items + 1, MAX_JSON_ITEMS, "values in its objects and arrays"),
                               (shape.strings, MAX_JSON_STRINGS, "strings"),
                               (shape.floats, MAX_JSON_FLOATS, "numbers with a fraction or exponent")):
        if count > bound:
            raise bad_request(f"The request body holds more than {bound} {what}; no request needs that many.")


def parse_json_body(raw: bytes) -> dict:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    _refuse_too_many_values(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    except ValueError as e:   # e.g. an integer literal past Python's 4300-digit limit (was a 500)
        if "integer string conversion" in str(e):   # its text named sys.set_int_max_str_digits to the client
            raise bad_request(f"The request body holds an integer of more than {sys.get_int_max_str_digits()} "
                              "digits; no field takes one.") from None
        raise bad_request(f"The request body is not usable JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw):   # only a \\uD800-\\uDFFF escape can make one: no walk without it
        _no_lone_surrogates(body)
    return body


# a surrogate in the text can only come from an escape (UTF-8 cannot encode one); an escaped
# backslash before "ud8.." matches too, which only costs the walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


def _no_lone_surrogates(body: dict) -> None:
    """JSON may escape half of a UTF-16 surrogate pair ("\\ud800") on its own; Python then
    holds a string that is not valid Unicode, which the tokenizer (and any UTF-8 encoder)
    refuses. Refuse it here, naming the top-level field, keys included."""
    stack = [(k, k, v) for k, v in body.items()]
    while stack:
        top, key, v = stack.pop()
        if isinstance(key, str) and _SURROGATE.search(key) or isinstance(v, str) and _SURROGATE.search(v):
            # the field is named only when it is a plain name: a top-level key is the client's
            # text, and went to the log and the answer whole (found in review: newlines forged
            # log lines, a 4 MiB key made a 4 MiB line)
            named = top if _PLAIN_NAME.fullmatch(top) else None
            where = f"'{named}'" if named else "The request body"
            raise bad_request(f"{where} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                              "pair); send valid Unicode text.", param=named)
        if isinstance(v, dict):
            stack.extend((top, k, x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((top, None, x) for x in v)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


# -- typed field access ------------------------------------------------------------------

_MISSING = object()


def _field(body: dict, name: str, kinds: tuple, default=None, what: str | None = None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what or _describe(kinds)}, got a boolean.", param=name)
    if not isinstance(v, kinds):
        raise bad_request(f"'{name}' must be {what or _describe(kinds)}, got {_type_name(v)}.", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number.", param=name)
    return v


def _int(body, name, default=None, lo=None, hi=None):
    v = _field(body, name, (int,), default, "an integer")
    return _range(name, v, lo, hi)


def _num(body, name, default=None, lo=None, hi=None):
    v = _field(body, name, (int, float), default, "a number")
    if v is None:
        return _range(name, None, lo, hi)
    try:
        f = float(v)
    except OverflowError:   # an integer too large for a float (was a 500)
        raise bad_request(f"'{name}' is out of range.", param=name) from None
    return _range(name, f, lo, hi)


def _bool(body, name, default=False):
    return _field(body, name, (bool,), default, "a boolean")


def _range(name, v, lo, hi):
    if v is None:
        return v
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}.", param=name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}.", param=name)
    return v


def _describe(kinds: tuple) -> str:
    return " or ".join(_type_name(k()) for k in kinds)


def _type_name(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


# -- shared sampling fields --------------------------------------------------------------

# Request fields (OpenAI's, or other servers' extensions) that change the answer in a way
# kvfence does not do: a client sending them would get an answer that silently ignores them
# (free text for a vLLM client's guided_json schema, text where it asked for audio). Refused
# with what to send instead, unless the value asks for what kvfence does anyway (the tuple;
# null is always "not set").
_STRUCTURED = "send 'response_format' of type json_schema (every token held to the schema)"
_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "guided_json": ((), f"vLLM's guided decoding is not a kvfence field; {_STRUCTURED}."),
    "guided_regex": ((), "regular-expression constraints are not supported; a JSON schema can hold a string to "
                         "a 'pattern': " + _STRUCTURED + "."),
    "guided_choice": ((), "vLLM's guided decoding is not a kvfence field; a JSON schema with an 'enum' does "
                          "it: " + _STRUCTURED + "."),
    "guided_grammar": ((), f"grammar constraints other than a JSON schema are not supported; {_STRUCTURED}."),
    "guided_decoding_backend": ((), f"vLLM's guided decoding is not a kvfence field; {_STRUCTURED}."),
    "guided_whitespace_pattern": ((), f"vLLM's guided decoding is not a kvfence field; {_STRUCTURED}."),
    "structured_outputs": ((), f"vLLM's structured_outputs is not a kvfence field; {_STRUCTURED}."),
    "regex": ((), "SGLang's regex constraint is not supported; a JSON schema can hold a string to a 'pattern': "
                  + _STRUCTURED + "."),
    "ebnf": ((), f"EBNF grammars are not supported; {_STRUCTURED}."),
    "use_beam_search": ((False,), "beam search is not supported; ask for n choices and pick by their logprobs."),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not supported."),
    "bad_words": (([],), "'bad_words' is not supported; 'logit_bias' of -100 on their token ids bans them."),
    "allowed_token_ids": (([],), "'allowed_token_ids' is not supported; 'logit_bias' can favour or ban tokens."),
    "truncate_prompt_tokens": ((), "kvfence never truncates a prompt: one longer than the context is a 400 "
                                   "(context_length_exceeded); shorten it yourself."),
    "chat_template": ((), "the model's own chat template is always used; per-request templates are not "
                          "supported."),
    "chat_template_kwargs": (({},), "per-request chat template arguments are not supported."),
    # chat takes both (_continuation) before this table is read
    "add_generation_prompt": ((True,), "the chat template ends with the assistant's turn here (a chat request "
                                       "may continue its last assistant message: 'continue_final_message')."),
    "continue_final_message": ((False,), "only a chat request continues its last assistant message."),
    "prompt_logprobs": ((), "send 'echo': true with 'logprobs' to /v1/completions for the prompt's logprobs."),
    "modalities": ((["text"],), "this model writes text only."),
    "audio": ((), "this model writes text only."),
    "web_search_options": ((), "kvfence has no web search; put what the model should know in the messages."),
    # llama.cpp's server fields: ignored, each would change the answer without a word
    "grammar": ((), f"GBNF grammars are not supported; {_STRUCTURED}."),
    "json_schema": ((), f"llama.cpp's top-level 'json_schema' is not a kvfence field; {_STRUCTURED}."),
    "n_predict": ((), "llama.cpp's 'n_predict' is not a kvfence field; send 'max_tokens'."),
    "repeat_penalty": ((1, 1.0), "llama.cpp's 'repeat_penalty' is not a kvfence field; send 'repetition_penalty'."),
    "typical_p": ((1, 1.0), "typical sampling is not supported; 'top_p', 'top_k' or 'min_p' narrow the choice."),
    "tfs_z": ((1, 1.0), "tail-free sampling is not supported; 'top_p', 'top_k' or 'min_p' narrow the choice."),
    "mirostat": ((0,), "mirostat sampling is not supported; 'temperature' with 'top_p' or 'min_p' instead."),
    "dry_multiplier": ((0, 0.0), "DRY repetition sampling is not supported; 'repetition_penalty' or "
                                 "'frequency_penalty' instead."),
    "xtc_probability": ((0, 0.0), "XTC sampling is not supported."),
    # vLLM's
    "logits_processors": ((), "per-request logits processors are not supported; 'logit_bias' favours or bans "
                              "tokens."),
    "return_tokens_as_token_ids": ((False,), "logprobs name their tokens as text here; /tokenize gives the ids."),
}

# chat only (a completion takes echo and best_of, see parse_completion)
_CHAT_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "chat answers do not repeat the prompt; send the text to /v1/completions with 'echo'."),
    "documents": ((), "chat template documents are not supported; put them in the messages."),
}


def unwanted_field(body: dict, table: dict[str, tuple[tuple, str]]) -> tuple[str, str] | None:
    """(name, why) of the first field of `table` that `body` sets to anything but null or one
    of its harmless values (compared with their type: 1 is not True), or None."""
    for name, (harmless, why) in table.items():
        v = body.get(name)
        if v is not None and not any(type(v) is type(h) and v == h for h in harmless):
            return name, why
    return None


def refuse_unsupported_fields(body: dict) -> None:
    """A 400 for a field that would change the answer in a way kvfence does not (_UNSUPPORTED)."""
    found = unwanted_field(body, _UNSUPPORTED)
    if found is not None:
        raise bad_request(f"'{found[0]}' is not supported: {found[1]}", param=found[0])


# OpenAI's own bounds on what is only stored and echoed (the Responses object echoes both in
# every event): without them a megabyte of metadata went out three times a streamed answer
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_USER_CHARS = 16, 64, 512, 512


def _metadata(meta: dict | None) -> None:
    if meta is None:
        return
    if len(meta) > MAX_METADATA_PAIRS:
        raise bad_request(f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs.", param="metadata")
    for k, v in meta.items():
        if len(k) > MAX_METADATA_KEY or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise bad_request(f"'metadata' keys are strings of at most {MAX_METADATA_KEY} characters and values "
                              f"strings of at most {MAX_METADATA_VALUE}.", param="metadata")   # its key is client text


def _common(body: dict, kind: str) -> dict:
    refuse_unsupported_fields(body)
    # accepted and ignored, but held to OpenAI's types: a wrong one is a client bug to hear of
    user = _field(body, "user", (str,), None, "a string")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise bad_request(f"'user' may be at most {MAX_USER_CHARS} characters.", param="user")
    _metadata(_field(body, "metadata", (dict,), None, "an object"))
    model = _field(body, "model", (str,), None, "a string")
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or an array of strings.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings.", param="stop")
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must not be empty.", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"'stop' strings may be at most {MAX_STOP_CHARS} characters long.", param="stop")
    stream = _bool(body, "stream", False)
    opts = _field(body, "stream_options", (dict,), None, "an object")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with stream=true.", param="stream_options")
        include_usage = opts.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise bad_request(f"'stream_options.include_usage' must be a boolean, got {_type_name(include_usage)}.",
                              param="stream_options.include_usage")
        include_usage = bool(include_usage)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in stop_ids):
        raise bad_request("'stop_token_ids' must be an array of non-negative integers.", param="stop_token_ids")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(t > MAX_STOP_TOKEN_ID for t in stop_ids):
        raise bad_request(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, each at most "
                          f"{MAX_STOP_TOKEN_ID}.", param="stop_token_ids")
    return dict(
        model=model, stream=stream, include_usage=include_usage, n=n,
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_int(body, "top_k", 0, -1, 1 << 20),
        seed=_int(body, "seed", None, -(2**63), 2**64 - 1),
        stop=stop, stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_repetition_penalty(body),
        min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=_int(body, "min_tokens", 0, 0, 1 << 20),
        logit_bias=_logit_bias(body),
        json_schema=_response_format(body),
    )


_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _response_format(body: dict) -> str | None:
    """OpenAI's response_format (also on /v1/completions, as vLLM takes it) -> the JSON schema
    the output is held to, as compact JSON, or None for plain text. Whether llguidance can
    compile it is checked in app.py, with the tokenizer."""
    fmt = _field(body, "response_format", (dict,), None, "an object")
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type":"object"}'
    if kind != "json_schema":
        raise bad_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
                          param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'.",
                          param="response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad_request("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'.",
                          param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean.", param="response_format")
    if "schema" not in spec or spec["schema"] is None:
        raise bad_request("'response_format.json_schema.schema' is required.", param="response_format")
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise bad_request(f"'response_format.json_schema.schema' must be a JSON Schema object, got "
                          f"{_type_name(schema)}.", param="response_format")
    try:
        return canonical_schema(held_as(schema, strict=spec.get("strict") is True))
    except ValueError as e:   # too large, or a number out of range: the reason names which
        raise bad_request(f"'response_format.json_schema.schema' {str(e).removeprefix('json_schema ')}.",
                          param="response_format") from None


MAX_LOGIT_BIAS = 1024


def _repetition_penalty(body: dict) -> float:
    return _num(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 2.0)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to values in
    [-100, 100]. The ids are checked against the model's vocabulary in app.py."""
    raw = _field(body, "logit_bias", (dict,), None, "an object")
    if not raw:
        return {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens.", param="logit_bias")
    out: dict[int, float] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9):
            raise bad_request(f"'logit_bias' keys must be token ids (non-negative integers), got {k!r}.",
                              param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100 or not math.isfinite(v):
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100]; token {k} has {v!r}.",
                              param="logit_bias")
        out[int(k)] = float(v)
    return out


def _params(c: dict, max_tokens: int | None, logprobs: int | None,
            max_tokens_param: str = "max_tokens") -> SamplingParams:
    if max_tokens is not None and c["min_tokens"] > max_tokens:   # in the API's words, not the engine's
        raise bad_request(f"'min_tokens' is {c['min_tokens']}, more than the {max_tokens} tokens the request's "
                          f"'{max_tokens_param}' allows.", param="min_tokens")
    try:
        return SamplingParams(temperature=c["temperature"], top_p=c["top_p"], top_k=c["top_k"], seed=c["seed"],
                              max_tokens=max_tokens, stop=c["stop"], stop_token_ids=c["stop_token_ids"],
                              ignore_eos=c["ignore_eos"], logprobs=logprobs,
                              skip_special_tokens=c["skip_special_tokens"],
                              include_stop_str_in_output=c["include_stop_str_in_output"],
                              presence_penalty=c["presence_penalty"], frequency_penalty=c["frequency_penalty"],
                              repetition_penalty=c["repetition_penalty"], min_p=c["min_p"],
                              min_tokens=c["min_tokens"], logit_bias=c["logit_bias"],
                              json_schema=c["json_schema"])
    except ValueError as e:   # SamplingParams' own checks ("min_tokens must be ..."): name the field
        first = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=first if first in c or first == "max_tokens" else None) from None


# -- /v1/completions ---------------------------------------------------------------------

def parse_completion(body: dict) -> GenerationRequest:
    c = _common(body, "completion")
    echo = _bool(body, "echo", False)
    if _field(body, "suffix", (str,), None):
        raise bad_request("'suffix' is not supported: this model has no fill-in-the-middle mode.", param="suffix")
    _refuse_best_of(body, c["n"])
    # max_tokens 0 with echo scores or returns the prompt alone (OpenAI's legacy behaviour,
    # which evaluation harnesses use); without echo there would be nothing to answer
    max_tokens = _int(body, "max_tokens", 16, 0, MAX_TOKENS_CAP)
    if max_tokens == 0 and not echo:
        raise bad_request("'max_tokens' must be at least 1 (0 is allowed only with echo, to return the prompt "
                          "and its logprobs alone).", param="max_tokens")
    logprobs = _int(body, "logprobs", None, 0, 20)
    prompts = _prompts(body.get("prompt", _MISSING))
    if len(prompts) * c["n"] > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={c['n']} is {len(prompts) * c['n']} choices; at most "
                          f"{MAX_CHOICES} per request.", param="prompt" if len(prompts) > 1 else "n")
    (text, ids), *more = prompts
    params = _params(c, max_tokens, logprobs)
    if echo and logprobs is not None:   # the echoed prompt's tokens come with their logprobs too
        params = dataclasses.replace(params, prompt_logprobs=logprobs)
    return GenerationRequest("completion", c["model"], params, c["stream"],
                             c["include_usage"], prompt_text=text, prompt_ids=ids, logprobs=logprobs, n=c["n"],
                             more_prompts=more or None, echo=echo)


def _prompts(p) -> list[tuple[str | None, list[int] | None]]:
    """OpenAI's prompt: a string, token ids, or a list of either (answered as choices in order)."""
    if p is _MISSING or p is None:
        raise bad_request("'prompt' is required.", param="prompt")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_CHOICES:
            raise bad_request(f"'prompt' may hold at most {MAX_CHOICES} prompts.", param="prompt")
        return [_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)]
    return [_prompt(p, "prompt")]


def _prompt(p, where: str) -> tuple[str | None, list[int] | None]:
    if isinstance(p, str):
        if p == "":
            raise bad_request(f"'{where}' is empty.", param="prompt")
        return p, None
    if isinstance(p, list):
        if not p:
            raise bad_request(f"'{where}' is empty.", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)
    raise bad_request(f"'{where}' must be a string or an array of token ids.", param="prompt")


# -- /v1/chat/completions ----------------------------------------------------------------

def _refuse_best_of(body: dict, n: int) -> None:
    best_of = _int(body, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        # vLLM dropped best_of too: ranking hidden candidates costs best_of sequences for n answers
        raise bad_request(f"'best_of' other than n is not supported (got best_of={best_of}, n={n}); ask for "
                          f"n={best_of} choices and pick by their logprobs.", param="best_of")


def parse_chat(body: dict) -> GenerationRequest:
    req, legacy = legacy_functions.parsed(body, _parse_chat)
    return dataclasses.replace(req, legacy_functions=True) if legacy else req


def _parse_chat(body: dict) -> GenerationRequest:
    found = unwanted_field(body, _CHAT_UNSUPPORTED)
    if found is not None:
        raise bad_request(f"'{found[0]}' is not supported: {found[1]}", param=found[0])
    body, continue_final = _continuation(body)
    c = _common(body, "chat")
    _refuse_best_of(body, c["n"])
    tools = parse_tools(body)
    c["json_schema"] = _held_to(tools, c["json_schema"])
    max_tokens = _int(body, "max_tokens", None, 1, MAX_TOKENS_CAP)
    mct = _int(body, "max_completion_tokens", None, 1, MAX_TOKENS_CAP)
    if mct is not None:
        max_tokens = mct
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, 20)
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    logprobs = (top or 0) if want else None
    messages = _messages(body.get("messages", _MISSING))
    limit = "max_tokens" if mct is None else "max_completion_tokens"
    if continue_final:
        _refuse_with_continuation(messages, tools, c["json_schema"])
    return GenerationRequest("chat", c["model"], _params(c, max_tokens, logprobs, limit), c["stream"],
                             c["include_usage"], messages=messages, logprobs=logprobs, prompt_param="messages",
                             n=c["n"], tools=tools, max_tokens_param=limit, continue_final=continue_final)


_CONTINUE_FIELDS = ("continue_final_message", "add_generation_prompt")


def _continuation(body: dict, plain_template_ok: bool = False) -> tuple[dict, bool]:
    """Whether the answer continues the last message, an assistant's, instead of starting a
    turn of its own: vLLM's `continue_final_message: true` (with `add_generation_prompt` false
    or left out), or DeepSeek's and Mistral's `"prefix": true` on that message. The body without
    what said so (the fields any other route refuses, the message's flag). `plain_template_ok`:
    `add_generation_prompt: false` alone is taken (/tokenize counts the template without it)."""
    cont = _bool(body, "continue_final_message", False)
    add = _bool(body, "add_generation_prompt", True)
    ms = body.get("messages")
    last = ms[-1] if isinstance(ms, list) and ms and isinstance(ms[-1], dict) else None
    prefix = last is not None and last.get("prefix") is True and last.get("role") == "assistant"
    if cont and add and "add_generation_prompt" in body:
        raise bad_request("'continue_final_message' goes on with the last message, and 'add_generation_prompt' "
                          "starts a new turn: set 'add_generation_prompt' to false (or leave it out).",
                          param="add_generation_prompt")
    if not add and not cont and not prefix and not plain_template_ok:
        raise bad_request("'add_generation_prompt': false is only supported with 'continue_final_message': true "
                          "(the answer goes on with the last assistant message); a chat answer otherwise starts "
                          "the assistant's turn.", param="add_generation_prompt")
    if not (cont or prefix):
        return body, False
    if not isinstance(ms, list) or last is None or last.get("role") != "assistant":   # so cont, not prefix
        raise bad_request("Only an assistant message can be continued: the last message must have role "
                          "'assistant'.", param="continue_final_message")
    body = {k: v for k, v in body.items() if k not in _CONTINUE_FIELDS}
    if prefix:
        body["messages"] = [*ms[:-1], {k: v for k, v in last.items() if k != "prefix"}]
    return body, True


def _refuse_with_continuation(messages: list[dict], tools: ToolSpec | None, json_schema: str | None) -> None:
    """What a continued message cannot go with: a tool call or a response format constrains an
    answer from its first character, which the message has already written."""
    where = f"messages[{len(messages) - 1}]"
    if messages[-1].get("tool_calls"):
        raise bad_request("An assistant message with tool_calls cannot be continued; send the tools' results "
                          "as 'tool' messages instead.", param=f"{where}.tool_calls")
    if tools is not None:
        raise bad_request("'tools' cannot go with a continued assistant message: a call starts an answer, and "
                          "this one has begun already.", param="tools")
    if json_schema is not None:
        raise bad_request("'response_format' cannot go with a continued assistant message: the format holds "
                          "the answer from its first character, and this one has begun already.",
                          param="response_format")


def _messages(ms) -> list[dict]:
    if ms is _MISSING or ms is None:
        raise bad_request("'messages' is required.", param="messages")
    if not isinstance(ms, list):
        raise bad_request(f"'messages' must be an array, got {_type_name(ms)}.", param="messages")
    if not ms:
        raise bad_request("'messages' is empty.", param="messages")
    if len(ms) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds {len(ms)} messages; at most {MAX_MESSAGES} are taken.", param="messages")
    out = []
    for i, m in enumerate(ms):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object.", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}.", param=f"{where}.role")
        if m.get("prefix") not in (None, False):   # DeepSeek's, Mistral's: the last assistant message only
            raise bad_request(f"'{where}.prefix' may only be true on the last message, an assistant's (the answer "
                              "then goes on with it).", param=f"{where}.prefix")
        msg: dict = {"role": role, "content": _content(m.get("content"), role, f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid or len(tid) > 256:
                raise bad_request(f"'{where}.tool_call_id' must name the call this result answers.",
                                  param=f"{where}.tool_call_id")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier calls, as {id, name, arguments}: parsed where they are JSON
    text, else the text itself. A call cut by max_tokens has unfinished arguments (ours too), and
    clients send such a call back with the tool's error (the Agents SDK, LangChain's invalid
    calls): OpenAI takes it, so it is written back as the string it was, not refused."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}' must be an array.", param=where)
    out = []
    for i, c in enumerate(calls):
        w = f"{where}[{i}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise bad_request(f"'{w}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\": JSON text}}}}.", param=w)
        args: object
        try:
            args = json.loads(f["arguments"]) if f["arguments"].strip() else {}
        except JSON_ERRORS:
            args = f["arguments"]
        out.append({"id": str(c.get("id", "")), "name": f["name"], "arguments": args})
    return out


def _content(c, role: str, where: str) -> str:
    if c is None and role in ("assistant", "tool"):
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        kinds = {"text": "text", "refusal": "refusal"} if role == "assistant" else {"text": "text"}
        return text_of_parts(c, where, kinds, '{"type": "text", "text": ...}')
    raise bad_request(f"'{where}' must be a string or an array of text parts.", param=where)


def text_of_parts(parts: list, where: str, kinds: dict[str, str], example: str) -> str:
    """A content array's text: each part's (`kinds`: part type -> the field holding its text),
    one per line, as vLLM joins them (run together, "Say" and "hi" read "Sayhi")."""
    out = []
    for j, part in enumerate(parts):
        key = kinds.get(str(part.get("type"))) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            raise bad_request(f"'{where}[{j}]' must be a text part ({example}); this model reads text only.",
                              param=f"{where}[{j}]")
        out.append(part[key])
    return "\n".join(out)


def _held_to(tools: ToolSpec | None, fmt: str | None) -> str | None:
    """The schema a chat answer is held to: a call of an allowed function (enforced), or with
    "auto" and a response_format the format's answer or one call (tools.answer_schema is set:
    the prompt then asks for the bare call form), else the format. A response_format governs
    text, as at OpenAI: a forced call has none, so the format (checked already) holds nothing."""
    try:
        if tools is not None and tools.enforced:
            return canonical_schema(call_schema(tools))
        if tools is not None and tools.active and fmt is not None:
            tools.answer_schema = fmt
            return canonical_schema(call_or_answer_schema(tools, fmt))
        return fmt
    except RecursionError:
        raise bad_request("The tools' parameter schemas are nested too deeply.", param="tools") from None
    except ValueError as e:
        raise bad_request(f"The tools' parameter schemas (with the response_format's): "
                          f"{str(e).replace('json_schema', 'the combined schema')}.", param="tools") from None


# -- /tokenize and /detokenize (vLLM's extension routes) -------------------------------------

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(NamedTuple):
    prompt: str | list[dict]          # prompt text, or chat messages
    add_generation_prompt: bool
    tools: ToolSpec | None            # the messages' tools
    continue_final: bool = False      # the messages end inside the last (assistant) message


def parse_tokenize(body: dict) -> TokenizeRequest:
    """A /tokenize body. Tools (and a response_format beside them) are read as chat
    completions reads them: a prompt that declares tools counts the tokens generation would
    send, tool descriptions included; so is a continued last message (continue_final_message
    or "prefix")."""
    _field(body, "model", (str,), None, "a string")
    return legacy_functions.parsed(body, _parse_tokenize)[0]


def _parse_tokenize(body: dict) -> TokenizeRequest:
    if "messages" in body and body["messages"] is not None:
        if body.get("prompt") is not None:
            raise bad_request("Give 'prompt' or 'messages', not both.", param="prompt")
        body, continued = _continuation(body, plain_template_ok=True)
        if continued:
            messages, tools = _messages(body["messages"]), parse_tools(body)
            _refuse_with_continuation(messages, tools, _response_format(body))
            return TokenizeRequest(messages, False, None, True)
        tools = parse_tools(body)
        _held_to(tools, _response_format(body))   # a format beside "auto" changes the tools' prompt
        return TokenizeRequest(_messages(body["messages"]), _bool(body, "add_generation_prompt", True), tools)
    if body.get("tools") is not None:
        raise bad_request("'tools' goes with 'messages', not with 'prompt'.", param="tools")
    p = body.get("prompt", _MISSING)
    if not isinstance(p, str):
        raise bad_request("'prompt' must be a string (or give 'messages').", param="prompt")
    return TokenizeRequest(p, False, None)


def parse_detokenize(body: dict) -> list[int]:
    _field(body, "model", (str,), None, "a string")
    ids = body.get("tokens", _MISSING)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("'tokens' must be an array of token ids.", param="tokens")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise bad_request(f"'tokens' may hold at most {MAX_DETOKENIZE_IDS} ids.", param="tokens")
    return ids
