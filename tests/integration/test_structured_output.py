"""Structured output on the real model: the grammar mask is what makes the greedy answer JSON
(with the mask off the same prompt is not), the answer validates against its schema, and a
grammar that fails mid-generation ends only its own request."""
from __future__ import annotations

import json

import jsonschema
import pytest

from kvfence.engine import logits_processors
from kvfence.engine.params import SamplingParams

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a person as JSON with name, age and city."}]


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def test_the_mask_makes_the_greedy_answer_valid_json(llm, monkeypatch):
    out = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=96, json_schema=PERSON))[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(_json(out.text), PERSON)
    # the same request with the mask applied as a no-op: the model's own greedy answer (a
    # fenced block and prose) is not JSON, so the test above passes because of the mask
    monkeypatch.setattr(logits_processors, "apply_grammar", lambda *a: None)
    unmasked = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=96, json_schema=PERSON))[0]
    assert _json(unmasked.text) is None, unmasked.text
    plain = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=96))[0]
    assert _json(plain.text) is None, plain.text


def test_json_object_on_a_plain_prompt(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=64,
                                                            json_schema={"type": "object"}))[0]
    assert out.finish_reason == "stop" and isinstance(_json(out.text), dict), out


def test_a_grammar_failing_mid_generation_ends_only_its_request(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode_chat(ASK)
    p = SamplingParams(temperature=0, max_tokens=48, json_schema=PERSON)
    broken = eng.add_request(ids, p)
    fine = eng.add_request(ids, p)
    other = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=8))
    assert broken.grammar is not None
    broken.grammar.matcher.consume_token(llm.tokenizer.encode("hello", add_special=False)[0])  # now in error
    while eng.has_unfinished():
        eng.step()
    assert broken.finish_reason == "aborted" and broken.abort_code == "grammar_error", broken.error
    assert fine.finish_reason == "stop"
    jsonschema.validate(_json(fine.text), PERSON)
    assert other.finish_reason == "length" and len(other.output_ids) == 8
    assert eng.ledger.num_owned == 0


def test_a_schema_past_llguidance_limits_is_the_clients_and_a_refused_token_is_ours(llm, monkeypatch):
    """This schema compiles (and passes the server's check) but a few tokens in llguidance
    gives up on the next mask: the schema's fault (grammar_limit_exceeded, a 400). A sampled
    token the mask would not have allowed is the server's (grammar_error, a 500)."""
    eng = llm.engine
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Pick a large number."}])
    costly = SamplingParams(temperature=0, max_tokens=32,
                            json_schema={"type": "integer", "multipleOf": 99991, "maximum": 1e12})
    limited = eng.add_request(ids, costly)
    other = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=8))
    while eng.has_unfinished():
        eng.step()
    assert limited.abort_code == "grammar_limit_exceeded" and "too many expressions" in limited.error, limited.error
    assert other.finish_reason == "length" and eng.ledger.num_owned == 0
    # the cached matcher's copies shared the budget it spent: its entry is dropped, so the
    # next request with the schema is built anew instead of failing at its first mask
    again = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1, json_schema=costly.json_schema))
    while eng.has_unfinished():
        eng.step()
    assert again.finish_reason == "length", again.error

    monkeypatch.setattr(logits_processors, "apply_grammar", lambda *a: None)   # sampled without the mask
    refused = eng.add_request(llm.tokenizer.encode_chat(ASK), SamplingParams(temperature=0, max_tokens=48,
                                                                          json_schema=PERSON))
    while eng.has_unfinished():
        eng.step()
    assert refused.abort_code == "grammar_error" and "refused token" in refused.error, refused.error


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_schema_and_min_tokens_that_leave_no_token_are_the_clients_400(llm, temperature):
    """min_tokens holds back the stop_token_ids; naming every token the schema allows first
    left a row of -inf: greedy sampled token 0 (a 500 grammar_error), multinomial raised (a 500
    engine_error). Found in review: it is the client's pair of settings, so its 400."""
    import numpy as np

    from kvfence.engine.grammar import fill_bitmask

    eng = llm.engine
    schema = {"type": "boolean"}
    first = eng.grammars.constraint("probe", json.dumps(schema))
    bits = np.unpackbits(fill_bitmask([first])[0].view(np.uint8), bitorder="little")
    allowed = [int(t) for t in np.nonzero(bits)[0] if t < first.vocab]
    assert 0 < len(allowed) < 64
    ids = llm.tokenizer.encode_chat(ASK)
    stuck = eng.add_request(ids, SamplingParams(temperature=temperature, max_tokens=4, min_tokens=1,
                                                stop_token_ids=allowed, json_schema=schema))
    other = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    assert stuck.abort_code == "grammar_limit_exceeded" and "min_tokens" in stuck.error, stuck.error
    assert other.finish_reason == "length" and eng.ledger.num_owned == 0
