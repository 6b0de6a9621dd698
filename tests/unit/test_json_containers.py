"""The bound on JSON objects and arrays in a request body (server/protocol.py): counted outside
strings, exactly, up to the bound; only what the parser would build counts."""
from __future__ import annotations

import json
import random

import pytest

from kvfence.server.errors import APIError
from kvfence.server.protocol import MAX_JSON_CONTAINERS, json_containers, parse_json_body


def _exact(value) -> int:
    """The reference: the containers of the parsed value, walked."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            count += 1
            stack += v.values()
        elif isinstance(v, list):
            count += 1
            stack += v
    return count


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
