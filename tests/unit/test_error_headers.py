"""Retry-After comes from an error's code in one place (errors.retry_after), whoever builds the
error: before, each raise site passed it or forgot it (engine_unavailable from a stopped engine
had none, so the openai client retried at once)."""
from __future__ import annotations

import pytest

from kvfence.server.errors import NOT_SERVING_CODES, RETRY_SOON_CODES, APIError


@pytest.mark.parametrize("code", sorted(RETRY_SOON_CODES | NOT_SERVING_CODES))
def test_every_retryable_code_carries_its_wait(code):
    got = APIError(503, "no", code=code).response().headers.get("retry-after")
    assert got == ("1" if code in RETRY_SOON_CODES else "5")


@pytest.mark.parametrize("code", ["kv_pool_exhausted", "kv_transfer_timeout", "invalid_request", None])
def test_other_codes_carry_none(code):
    """Capacity codes: clients back off with jitter (a fixed second would bring them back together)."""
    assert "retry-after" not in APIError(503, "no", code=code).response().headers


def test_a_caller_may_say_its_own_wait():
    err = APIError(503, "no", code="server_overloaded", headers={"Retry-After": "7"})
    assert err.response().headers["retry-after"] == "7"
