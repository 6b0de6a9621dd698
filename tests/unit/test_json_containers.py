"""The bounds on what a request body's JSON would build (server/protocol.py): objects and
arrays, keys, items and strings, counted outside strings, exactly; only what the parser would
build counts."""
from __future__ import annotations

import json
import random

import pytest

from kvfence.server.errors import APIError
from kvfence.server.protocol import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_FLOATS,
    MAX_JSON_ITEMS,
    MAX_JSON_MEMBERS,
    MAX_JSON_STRINGS,
    json_shape,
    parse_json_body,
)


def json_containers(raw: bytes) -> int:
    return json_shape(raw).containers


def _exact(value) -> int:
    """The reference: the containers of the parsed value, walked."""
    return _exact_shape(value)[0]


def _exact_shape(value) -> tuple[int, int, int, int]:
    """The reference: (containers, keys, items after the first of each, strings) of the parsed value."""
    containers = members = items = strings = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            containers, members, strings = containers + 1, members + len(v), strings + len(v)
            items += max(len(v) - 1, 0)
            stack += v.values()
        elif isinstance(v, list):
            containers, items = containers + 1, items + max(len(v) - 1, 0)
            stack += v
        elif isinstance(v, str):
            strings += 1
    return containers, members, items, strings


def _random_value(r: random.Random, depth: int = 0):
    kind = r.random()
    if depth > 4 or kind < 0.35:
        return r.choice(['{"', '[', 'a\\"{', '\\\\', '"', '\\', "plain", "x\\\\\"[", ""]) * r.randint(0, 3)
    if kind < 0.45:
        return r.randint(-5, 5)
    if kind < 0.7:
        return [_random_value(r, depth + 1) for _ in range(r.randint(0, 4))]
    return {r.choice(["a", "{", "[\\\"", "k"]) + str(i): _random_value(r, depth + 1) for i in range(r.randint(0, 4))}


@pytest.mark.parametrize("chunk", [5, 1 << 20])   # strings that span the scan's chunks, and not
def test_the_count_is_the_parsers_for_bodies_with_brackets_and_escapes_in_strings(chunk, monkeypatch):
    import kvfence.server.protocol as protocol
    monkeypatch.setattr(protocol, "_SCAN_CHUNK", chunk)
    for seed in range(300):
        value = {"v": _random_value(random.Random(seed))}
        raw = json.dumps(value, ensure_ascii=bool(seed % 2), indent=None if seed % 3 else 1).encode()
        assert json_containers(raw) == _exact(value), raw
        shape = json_shape(raw)
        assert (shape.containers, shape.members, shape.items, shape.strings) == _exact_shape(value), raw


def test_runs_of_backslashes_and_quotes_pair_as_the_reader_pairs_them():
    for run in range(7):
        text = "\\" * run + '"' + "[{" + "\\" * (run % 3)
        value = {"t": text, "l": [[text], {"k": [text]}]}
        raw = json.dumps(value).encode()
        assert json_containers(raw) == _exact(value) == 5, raw


def test_millions_of_short_strings_holding_brackets_count_exactly():
    """The shape that made a loop over strings cost ~1 s: the count must still be exact."""
    value = {"s": ["[", '\\"{', "", "x"] * 250_000, "a": [[1]] * 1000}
    raw = json.dumps(value).encode()
    assert json_containers(raw) == 1 + 1 + 1 + 1000


def test_a_body_of_many_small_arrays_is_refused_before_parsing_and_braces_in_text_are_not():
    many = b'{"prompt":"hi","x":[' + b",".join([b"[1]"] * (MAX_JSON_CONTAINERS + 1)) + b"]}"
    with pytest.raises(APIError) as e:
        parse_json_body(many)
    assert e.value.status == 400 and "objects and arrays" in str(e.value)
    text = json.dumps({"prompt": "{[" * (MAX_JSON_CONTAINERS + 5) + '\\"'}).encode()   # in a string: fine
    assert parse_json_body(text)["prompt"].startswith("{[")
    at_bound = b'{"x":[' + b",".join([b"[]"] * (MAX_JSON_CONTAINERS - 2)) + b"]}"
    assert len(parse_json_body(at_bound)["x"]) == MAX_JSON_CONTAINERS - 2


def test_an_integer_too_long_for_python_is_named_without_its_interpreter_advice():
    """The 400 quoted Python's ValueError, which tells the client to call
    sys.set_int_max_str_digits() (found by the parity probe)."""
    import pytest

    from kvfence.server.errors import APIError
    from kvfence.server.protocol import parse_json_body

    with pytest.raises(APIError) as e:
        parse_json_body(b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}")
    assert e.value.status == 400 and "integer of more than 4300 digits" in e.value.message
    assert "sys." not in e.value.message


@pytest.mark.parametrize("name,bound,body", [
    ("object keys", MAX_JSON_MEMBERS,   # the probe's 760K logit_bias keys: 0.44 s of parsing, then refused
     lambda n: b'{"prompt":"hi","logit_bias":{' + b",".join(b'"%d":1' % i for i in range(n)) + b"}}"),
    ("values in its objects and arrays", MAX_JSON_ITEMS,   # 4M integers: 0.19 s
     lambda n: b'{"prompt":[' + b",".join([b"7"] * n) + b"]}"),
    ("strings", MAX_JSON_STRINGS,   # 1.6M short strings, each walked for surrogates: ~0.8 s
     lambda n: b'{"prompt":[' + b",".join([b'"a"'] * n) + b"]}"),
    ("numbers with a fraction or exponent", MAX_JSON_FLOATS,   # 1M of them: ~0.2 s
     lambda n: b'{"x":[' + b",".join([b"0.5", b"1e5"] * (n // 2) + [b"2.5"] * (n % 2)) + b"]}"),
])
def test_a_body_over_a_bound_is_refused_before_parsing_and_one_at_it_parses(name, bound, body, monkeypatch):
    import kvfence.server.protocol as protocol

    def no_parse(*a, **k):
        raise AssertionError("parsed")

    over = body(bound + 1)
    monkeypatch.setattr(protocol.json, "loads", no_parse)
    with pytest.raises(APIError) as e:
        parse_json_body(over)
    assert e.value.status == 400 and name in str(e.value) and str(bound) in str(e.value)
    monkeypatch.undo()
    if name != "object keys":   # the keys' body has one more string per key: at its bound it is over the other
        assert isinstance(parse_json_body(body(bound - 2)), dict)
    text = json.dumps({"prompt": ':,".e1e' * (bound + 5)}).encode()   # in a string: fine
    assert parse_json_body(text)["prompt"].startswith(':,".e1e')


def test_a_lone_surrogate_is_refused_with_or_without_other_escapes_and_a_pair_is_not():
    for raw in (b'{"prompt":"a\\ud800b"}', b'{"prompt":"\\u00e9","x":["\\uDC00"]}'):
        with pytest.raises(APIError, match="surrogate"):
            parse_json_body(raw)
    assert parse_json_body(b'{"prompt":"\\ud83d\\ude00"}')["prompt"] == "\U0001f600"
    assert parse_json_body(b'{"prompt":"\\\\ud800"}')["prompt"] == "\\ud800"   # an escaped backslash: text
