"""The prefill cap sized from a step-time target (engine/step_target.py), on a simulated machine
whose step costs a + b * prefill tokens: the cap settles where a step meets the target, follows
the machine when it slows down or speeds up, and stays within one page and the ceiling."""
from __future__ import annotations

import pytest

from kvfence.engine.step_target import StepTarget


def run(st: StepTarget, base_s: float, per_token_s: float, steps: int = 40) -> list[float]:
    """Alternate decode-only steps and steps that decode and prefill as much as the cap allows;
    the times of the latter."""
    times = []
    for _ in range(steps):
        st.observe(0, 8, base_s)
        p = st.cap
        t = base_s + per_token_s * p
        st.observe(p, 8, t)
        times.append(t)
    return times


def test_the_ceiling_until_both_costs_are_known():
    st = StepTarget(0.2, ceiling=256, page=16)
    assert st.cap == 256
    st.observe(0, 8, 0.05)
    assert st.cap == 256          # a decode step alone says nothing of a prompt token's cost
    st.observe(256, 8, 0.05 + 256 * 0.0025)
    assert st.cap == 48           # (0.2 - 0.05) / 0.0025 = 60 tokens: three whole pages


def test_a_prompt_into_an_idle_engine_gives_the_first_guess():
    st = StepTarget(0.2, ceiling=256, page=16)
    st.observe(512, 0, 0.02 + 512 * 0.0025)   # no stream waited on it: T / p, a's share included
    st.observe(2048, 0, 1.0)                  # a guess is not refined by more guesses
    assert st.per_token_s == pytest.approx(0.0025 + 0.02 / 512) and st.cap == 256
    st.observe(0, 8, 0.05)
    assert st.cap == 48                       # sized before the first step that decodes and prefills


def test_a_slow_machine_gets_steps_under_the_target():
    times = run(StepTarget(0.2, ceiling=256, page=16), base_s=0.05, per_token_s=0.0025)
    assert times[0] > 0.6                          # the first, at the ceiling: 690 ms
    assert all(t <= 0.2 for t in times[1:])        # every later one within 200 ms
    assert times[-1] > 0.2 - 0.0025 * 16           # and not a page short of it


def test_scattered_steps_are_planned_below_the_target_so_the_slow_ones_meet_it():
    st = StepTarget(0.2, ceiling=256, page=16)
    times = []
    for i in range(60):
        st.observe(0, 8, 0.04)
        p = st.cap
        t = (0.04 + 0.0025 * p) * (1.1 if i % 2 else 0.9)   # every other step 10% slow, 10% fast
        st.observe(p, 8, t)
        times.append(t)
    assert 0.05 < st.scatter < 0.15
    assert max(times[10:]) <= 0.2                           # planned for the mean, half would miss


def test_a_fast_machine_keeps_the_ceiling():
    times = run(StepTarget(0.2, ceiling=256, page=16), base_s=0.03, per_token_s=0.0005)
    assert all(t == pytest.approx(0.03 + 256 * 0.0005) for t in times)


def test_the_cap_follows_the_machine_when_it_slows_down_and_recovers():
    st = StepTarget(0.2, ceiling=256, page=16)
    run(st, 0.03, 0.0005)
    assert st.cap == 256
    slow = run(st, 0.06, 0.002)                    # a noisy neighbour: every cost up 2-4x
    assert st.cap == 64 and max(slow[-10:]) <= 0.2
    run(st, 0.03, 0.0005)
    assert st.cap == 256


def test_never_below_one_page_even_when_decoding_alone_misses_the_target():
    st = StepTarget(0.2, ceiling=256, page=16)
    run(st, base_s=0.5, per_token_s=0.001)
    assert st.cap == 16           # prompts still progress, a page a step


def test_steps_that_say_nothing_change_nothing():
    st = StepTarget(0.2, ceiling=256, page=16)
    st.observe(8, 0, 1.0)         # a prompt under a page into an idle engine
    st.observe(0, 4, 0.0)         # a clock that did not move
    assert st.base_s is None and st.per_token_s is None and st.cap == 256
    st.observe(0, 4, 0.05)
    st.observe(8, 4, 0.5)         # under a page of prefill: too little to price a token
    assert st.per_token_s is None


@pytest.mark.parametrize("bad", [dict(target_s=0.0), dict(ceiling=8), dict(page=0)])
def test_settings_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError, match="step target"):
        StepTarget(**{**dict(target_s=0.2, ceiling=256, page=16), **bad})
