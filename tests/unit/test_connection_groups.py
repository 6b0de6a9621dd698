"""Open connections are counted per client as the wrong-key throttle counts it
(http_limits.address_group): an IPv6 client's /64, which one host commonly holds whole. A
security probe noted they were counted per exact address, so one IPv6 host could take every
connection from addresses of its own /64."""
from __future__ import annotations

import asyncio

from fake_connections import FakeServer

from kvfence.server.http_limits import HttpLimits


def _refused(peers: list[str]) -> list[bool]:
    """Connect from each peer in turn (2 per client allowed); which were refused at once."""
    async def go() -> list[bool]:
        server = FakeServer(HttpLimits(max_connections=100, max_connections_per_address=2))
        out = [server.connect((peer, 5000, 0, 0) if ":" in peer else (peer, 5000)).out.startswith(b"HTTP/1.1 503")
               for peer in peers]
        server.lose_all()
        return out

    return asyncio.run(go())


def test_one_ipv6_slash_64_is_one_client():
    assert _refused(["2001:db8::1", "2001:db8::2", "2001:db8::3"]) == [False, False, True]
    assert _refused(["2001:db8::1", "2001:db8::2", "2001:db8:0:1::3"]) == [False, False, False]   # another /64


def test_ipv4_addresses_and_their_mapped_form_are_one_client():
    assert _refused(["10.0.0.1", "::ffff:10.0.0.1", "10.0.0.1"]) == [False, False, True]
    assert _refused(["10.0.0.1", "10.0.0.2", "10.0.0.3"]) == [False, False, False]


def test_a_trusted_proxy_does_not_use_up_its_neighbours_count():
    """Review: the proxy's own connections were counted in its /64, so an untrusted address
    beside it was refused once the proxy held more than the per-address count."""
    async def go() -> list[bool]:
        server = FakeServer(HttpLimits(max_connections=100, max_connections_per_address=2,
                                       trusted_proxies=("2001:db8::1",)))
        out = [server.connect((peer, 5000, 0, 0)).out.startswith(b"HTTP/1.1 503")
               for peer in ["2001:db8::1"] * 5 + ["2001:db8::99", "2001:db8::98", "2001:db8::97"]]
        server.lose_all()
        return out

    assert asyncio.run(go()) == [False] * 7 + [True]
