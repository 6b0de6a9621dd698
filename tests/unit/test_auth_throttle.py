"""FailedAuthThrottle: failures per address in a fixed window, the bound on its table."""
from __future__ import annotations

from kvfence.server.auth_throttle import FailedAuthThrottle


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_held_back_after_its_limit_until_its_window_ends():
    clock = Clock()
    t = FailedAuthThrottle(limit=3, window_s=60, clock=clock)
    for _ in range(3):
        assert t.retry_after("10.0.0.1") is None
        t.failed("10.0.0.1")
    assert t.retry_after("10.0.0.1") == 60
    assert t.retry_after("10.0.0.2") is None           # another address is not affected
    clock.now += 59.5
    assert t.retry_after("10.0.0.1") == 1
    clock.now += 0.5
    assert t.retry_after("10.0.0.1") is None            # a new window
    t.failed("10.0.0.1")
    assert t.retry_after("10.0.0.1") is None


def test_the_table_keeps_at_most_max_addresses():
    t = FailedAuthThrottle(limit=1, max_addresses=4, clock=Clock())
    for i in range(10):
        t.failed(f"10.0.0.{i}")
    assert len(t._windows) == 4
    assert t.retry_after("10.0.0.9") is not None and t.retry_after("10.0.0.0") is None


def test_an_ipv6_client_counts_by_its_64_and_a_mapped_ipv4_one_as_ipv4():
    """Found in review: counted per exact address, one host's /64 gave it 2^64 addresses to
    guess from; 200 of them made 6,000 guesses a minute past a limit of 30."""
    from kvfence.server.auth_throttle import address_group

    t = FailedAuthThrottle(limit=3, window_s=60, clock=Clock())
    for i in range(3):
        t.failed(f"2001:db8:1:2::{i + 1:x}")
    assert t.retry_after("2001:db8:1:2:ffff::9") == 60      # the same /64
    assert t.retry_after("2001:db8:1:3::1") is None          # the next /64 is another client
    for _ in range(3):
        t.failed("::ffff:10.0.0.7")
    assert t.retry_after("10.0.0.7") == 60
    assert address_group("10.0.0.7") == "10.0.0.7" and address_group("unknown") == "unknown"


def test_a_full_table_keeps_held_back_addresses_over_new_ones():
    """Dropping the oldest window first let a guesser lift its own hold: one failure from each
    of MAX_ADDRESSES other addresses pushed its window out of the table."""
    clock = Clock()
    t = FailedAuthThrottle(limit=3, window_s=60, max_addresses=4, clock=clock)
    for _ in range(3):
        t.failed("10.0.0.1")
    for i in range(2, 40):   # one failure each: under the limit, so these go first
        t.failed(f"10.0.1.{i}")
        assert t.retry_after("10.0.0.1") == 60
    assert len(t._windows) == 4 and "10.0.1.39" in t._windows
    clock.now += 61           # an ended window makes room before any live one goes
    for _ in range(3):
        t.failed("10.0.0.2")
    assert t.retry_after("10.0.0.2") == 60 and len(t._windows) == 1


def test_when_every_window_is_held_back_the_oldest_hold_goes():
    """A new address is still counted (else it could guess without bound)."""
    t = FailedAuthThrottle(limit=1, max_addresses=2, clock=Clock())
    for a in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        t.failed(a)
    assert t.retry_after("10.0.0.1") is None
    assert t.retry_after("10.0.0.2") is not None and t.retry_after("10.0.0.3") is not None


def test_a_throttled_address_is_told_why_its_detail_is_withheld():
    """/health and the router's /v1/kvfence/cluster keep answering a throttled address (probes
    share addresses) without the operator's detail; a request that sent a key is told why (the
    cluster route told it to send the key it had sent: a security probe)."""
    from types import SimpleNamespace

    from starlette.requests import Request

    from kvfence.server.app import detail_withheld

    state = SimpleNamespace(key_throttle=FailedAuthThrottle(limit=1, window_s=60, clock=Clock()))

    def request(key: str | None) -> Request:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        return Request({"type": "http", "headers": headers, "client": ("10.0.0.7", 5)})

    assert detail_withheld(state, request("sk-right")) is None
    state.key_throttle.failed("10.0.0.7")
    assert "try again in 60 s" in detail_withheld(state, request("sk-right"))
    assert detail_withheld(state, request(None)) is None   # no key sent: nothing to explain
