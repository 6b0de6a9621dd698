"""A PD node's timers are checked when they are made: each one bounds a fence (I6), so a
value that would shorten a fence, or make every comparison with it false, is refused."""
from __future__ import annotations

import pytest

from kvfence.pd.settings import PDSettings

SECRET = b"s" * 32


@pytest.mark.parametrize("field,value", [
    ("clock_skew_s", -1.0),           # found in review: a negative skew shortened every fence
    ("clock_skew_s", float("nan")),
    ("lease_s", float("nan")),        # found in review: NaN passed the lease-vs-skew check
    ("lease_s", 0.0),
    ("max_pull_s", float("inf")),
    ("max_pull_s", -3.0),
    ("pull_give_up_s", 0.0),
    ("transfer_timeout_s", 0),
    ("transfer_buffer_pages", 0),
])
def test_timers_that_would_weaken_a_fence_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        PDSettings("decode", cluster_secret=SECRET, **{field: value})


def test_the_fence_covers_the_longest_pull_and_the_skew():
    s = PDSettings("prefill", cluster_secret=SECRET, lease_s=5.0, max_pull_s=8.0, clock_skew_s=0.5)
    assert s.fence_after(100.0) == 108.5
    assert PDSettings("decode", cluster_secret=SECRET, clock_skew_s=0.0).clock_skew_s == 0.0
