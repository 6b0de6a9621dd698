"""The logit adjustments against their definitions, written out element by element (OpenAI's
presence/frequency penalties, vLLM's repetition penalty, logit_bias, min_tokens, min_p), and
their passage through the sampler: greedy rows adjusted, logprobs left as the model's."""
from __future__ import annotations

import math

import pytest
import torch

from kvfence.engine.logits_processors import History, adjust
from kvfence.engine.params import SamplingParams
from kvfence.engine.sampler import Sampler
from kvfence.pd.messages import WireParams

V = 50


def _reference(row: list[float], p: SamplingParams, h: History) -> list[float]:
    out = list(row)
    for t, b in p.logit_bias.items():
        out[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(h.prompt_ids) | set(h.output_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(h.output_ids):
        c = h.output_ids.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(h.output_ids) < p.min_tokens:
        for t in h.end_ids:
            out[t] = -math.inf
    return out


@pytest.mark.parametrize("kw", [
    dict(presence_penalty=0.7), dict(frequency_penalty=1.3), dict(frequency_penalty=-0.5, presence_penalty=2.0),
    dict(repetition_penalty=1.4), dict(repetition_penalty=0.6), dict(logit_bias={3: 100.0, 7: -100.0, 9: 2.5}),
    dict(min_tokens=5, max_tokens=10), dict(min_tokens=2, max_tokens=10),
    dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={1: -3.0}, min_tokens=9,
         max_tokens=20),
])
def test_adjust_matches_the_definitions(kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g) * 3
    p = SamplingParams(**kw)
    h = History(prompt_ids=[1, 2, 3, 2], output_ids=[5, 5, 6, 2], end_ids=frozenset({0, 11}))
    plain = SamplingParams()
    out = adjust(logits, [p, plain], [h, h])
    want = _reference(logits[0].tolist(), p, h)
    assert out[0].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert torch.equal(out[1], logits[1])          # a row that asks for nothing is untouched
    assert out is not logits                       # a copy: the model's logits stay for logprobs


def test_nothing_asked_nothing_copied():
    logits = torch.randn(3, V)
    assert adjust(logits, [SamplingParams()] * 3, [History([], [], frozenset())] * 3) is logits


def test_greedy_rows_are_adjusted_and_logprobs_stay_the_models():
    logits = torch.zeros(1, V)
    logits[0, 4] = 5.0
    p = SamplingParams(temperature=0.0, logit_bias={9: 100.0}, logprobs=1)
    out = Sampler()(logits, [p], [None], [History([1], [], frozenset())])
    assert out.token_ids == [9]
    lp = out.logprobs[0]
    assert lp.top[0][0] == 4                                  # the model's own best token ...
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[9].item())   # ... and its logprob of 9


def test_min_p_removes_the_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, min_p=0.4, seed=1)
    drawn = {Sampler()(logits, [p], [torch.Generator().manual_seed(s)], None).token_ids[0] for s in range(200)}
    assert drawn == {0, 1}                                    # 0.15 and 0.05 are below 0.4 x 0.5


def test_the_sampler_refuses_adjustments_without_histories():
    with pytest.raises(ValueError, match="history"):
        Sampler()(torch.zeros(1, V), [SamplingParams(frequency_penalty=1.0)], [None])


@pytest.mark.parametrize("kw,match", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_out_of_range_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_the_fields_cross_the_pd_wire_unchanged():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3, min_p=0.1, min_tokens=3,
                       logit_bias={42: -100.0, 7: 3.5}, max_tokens=8)
    back = WireParams.from_json(WireParams.of(p).dumps()).to_params()
    assert back == p


def test_counts_kept_across_steps_give_what_counting_afresh_gives():
    """Penalties read a request's TokenCounts, updated a token at a time (counting the whole
    history every step cost O(history) a row, found in review); every step's adjusted logits
    equal those of a fresh count, also when the output is cut back (counted again)."""
    from kvfence.engine.logits_processors import TokenCounts

    g = torch.Generator().manual_seed(1)
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, max_tokens=50)
    kept, prompt, output = TokenCounts(), [3, 1, 3, V + 5], []
    for step in range(40):
        logits = torch.randn(1, V, generator=g) * 3
        with_kept = adjust(logits, [p], [History(prompt, list(output), frozenset(), counts=kept)])
        afresh = adjust(logits, [p], [History(prompt, list(output), frozenset())])
        assert torch.equal(with_kept, afresh), step
        assert torch.allclose(with_kept, _penalized_by_hand(logits, p, prompt, output), atol=1e-5), step
        output.append(int(torch.randint(0, V, (1,), generator=g)))
        if step == 25:
            output = output[:10]


def _penalized_by_hand(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The penalties written out token by token from their definitions, with no TokenCounts:
    repetition (vLLM's, over prompt and output), then OpenAI's frequency and presence (output)."""
    from collections import Counter

    row = [float(x) for x in logits[0]]
    for t in {t for t in prompt + output if 0 <= t < V}:
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, n in Counter(t for t in output if 0 <= t < V).items():
        row[t] -= p.frequency_penalty * n + p.presence_penalty
    return torch.tensor([row], dtype=torch.float32)


def test_the_hand_reference_sees_a_wrong_count():
    """The reference above can fail: one token counted twice too many is seen."""
    p = SamplingParams(frequency_penalty=0.7, max_tokens=5)
    logits = torch.zeros(1, V)
    good = adjust(logits, [p], [History([1], [4, 4, 9], frozenset())])
    assert torch.allclose(good, _penalized_by_hand(logits, p, [1], [4, 4, 9]))
    assert not torch.allclose(good, _penalized_by_hand(logits, p, [1], [4, 4, 4, 4, 9]))


def test_bias_and_held_ids_kept_across_steps_give_what_building_afresh_gives():
    """logit_bias and min_tokens' held-back ids are index tensors built at a request's first step
    and kept (rebuilt from Python every step they cost 8.4 ms a step at n=16 with 1,024 of
    each); every step equals the definitions, the hold ends at min_tokens, and ids past the
    vocabulary are left out."""
    from kvfence.engine.logits_processors import FixedAdjustments

    g = torch.Generator().manual_seed(2)
    bias = {t: float(t % 7) - 3.0 for t in range(0, V, 3)}
    p = SamplingParams(logit_bias={**bias, V + 4: 1.0}, min_tokens=6, max_tokens=20, stop_token_ids=[4, V + 2])
    held = frozenset({0, 4, V + 2})
    kept, output = FixedAdjustments(held), []
    for step in range(10):
        logits = torch.randn(1, V, generator=g) * 3
        got = adjust(logits, [p], [History([1], list(output), held, fixed=kept)])
        want = _reference(logits[0].tolist(), SamplingParams(logit_bias=bias), History([1], list(output), frozenset()))
        if len(output) < 6:
            want = [-math.inf if t in (0, 4) else w for t, w in enumerate(want)]
        assert got[0].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), step
        assert torch.isinf(got[0, 4]) == (step < 6)
        output.append(5)
        if step == 0:
            built = (kept.bias_ids, kept.held_ids)
    assert kept.bias_ids is built[0] and kept.held_ids is built[1]   # the same tensors at every step: built once
    assert kept.bias_ids.numel() == len(bias) and kept.held_ids.tolist() == [0, 4]
