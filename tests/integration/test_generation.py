"""Sampling options through the whole engine: seeds, stops, logprobs, streaming text."""
from __future__ import annotations

import math

import pytest

from kvfence import SamplingParams


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Write a line about the sea:"], p)[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=25, ignore_eos=True)
    mixed = llm.generate(["Something else entirely", "Write a line about the sea:", "And a third"],
                         [other, p, other])
    assert mixed[1].token_ids == alone
    different_seed = llm.generate(["Write a line about the sea:"],
                                  SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20,
                                                 ignore_eos=True))[0].token_ids
    assert different_seed != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(["Paris is the capital of"], SamplingParams(temperature=0, max_tokens=12))[0]
    topk1 = llm.generate(["Paris is the capital of"], SamplingParams(temperature=1.5, top_k=1, max_tokens=12,
                                                                     seed=3))[0]
    assert topk1.token_ids == greedy.token_ids


def test_stop_string_cuts_text_and_ends_request(llm):
    full = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=30))[0]
    assert "return" in full.text
    cut = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=30, stop=["return"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("return")]


def test_stop_token_ids_and_eos(llm):
    full = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = full.token_ids[3]
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    chat = llm.chat([{"role": "user", "content": "Reply with just the word yes."}],
                    SamplingParams(temperature=0, max_tokens=60))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.tokenizer.end_ids
    assert "<|im_end|>" not in chat.text


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(llm):
    out = llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the most likely
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6)
        assert sum(math.exp(x) for _, x in lp.top) <= 1.0 + 1e-5


def test_streamed_deltas_add_up_to_the_text_with_multibyte_output(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Write three emoji and a Japanese word."}])
    seq = eng.add_request(ids, SamplingParams(temperature=0.8, seed=5, max_tokens=40))
    deltas = []
    while eng.has_unfinished():
        deltas += [o.delta_text for o in eng.step() if o.seq is seq]
    assert "".join(deltas) == seq.text
    assert "\ufffd" not in seq.text or "\ufffd" in llm.tokenizer.decode(seq.output_ids)


def test_invalid_params_and_prompts_are_refused_clearly(llm):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)   # 0 is valid: compute the prompt, sample nothing
    outs = llm.generate([[], [10**9]], SamplingParams(max_tokens=2))
    assert all(o.finish_reason == "rejected" for o in outs)
    assert "empty" in outs[0].error and "token ids" in outs[1].error


def test_a_negative_prefill_cap_is_refused_at_start(make_llm):
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding must be >= 0"):
        make_llm(prefill_tokens_while_decoding=-1)
    with pytest.raises(ValueError, match="decode_step_target_ms must be >= 0"):
        make_llm(decode_step_target_ms=float("nan"))


def prompt_steps_while_streaming(eng) -> list[int]:
    """A stream decodes; a 200-token prompt arrives: the prompt tokens each step computes while
    the stream goes on."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = eng.add_request(list(range(300, 320)), params)
    while not stream.output_ids:
        eng.step()
    eng.step()                                   # one step that only decodes: its cost
    late = eng.add_request(list(range(400, 600)), params)
    steps = []
    while late.num_computed < 200 and not stream.finished:
        before = late.num_computed
        eng.step()
        steps.append(late.num_computed - before)
    return steps


def test_the_prefill_cap_shrinks_to_the_step_time_target(make_llm):
    """The real engine learns a step's costs as it runs (engine/step_target.py): with a target
    no step can meet, every prompt chunk beside a stream is a single page (the stream's own
    prompt priced a token, its decode step the rest); with the target off, every chunk is the
    ceiling."""
    fixed = prompt_steps_while_streaming(make_llm(prefill_tokens_while_decoding=64, decode_step_target_ms=0).engine)
    assert fixed == [64, 64, 64, 8]
    eng = make_llm(prefill_tokens_while_decoding=64, decode_step_target_ms=0.001).engine
    sized = prompt_steps_while_streaming(eng)
    assert sized == [16] * 12 + [8]
    assert eng.stats()["prefill_cap_while_decoding"] == 16
