"""Connection-level limits for every kvfence HTTP server (single node, PD nodes, router).

uvicorn bounds header size (h11's incomplete-event limit) and can cap connections
(`limit_concurrency`, answered 503: here in the API's error shape, `server_overloaded`, with
Retry-After), but it has no read deadline: a client that sends half a
request line, or a body one byte every few seconds, holds its connection and its share of the
server forever (slowloris). `GuardedH11Protocol` adds two deadlines, checked once a second:

- the request line and headers must arrive within `header_timeout_s` of the connection
  opening or of the previous response ending (then 408 and close);
- the whole body must arrive within `body_timeout_s` of the headers (then the connection is
  closed; the app sees a disconnect and frees whatever it held).

A response may stream for as long as it generates, but not for longer than its client reads
it: once bytes have waited for `send_timeout_s` (in asyncio's buffer or the kernel's send queue)
with none acknowledged by the client's TCP, the connection is reset (a slow-read attack;
asyncio would keep the bytes, and the kernel its megabytes, for good).

One client address may hold at most `max_connections_per_address` of the connections (half of
them by default; an IPv6 client's /64 counts as one address): past it, a new connection from that
address is answered 503 and closed before it is read, so one client cannot take every
connection and lock the others out.

Behind a reverse proxy every client has the proxy's address. The operator names the proxy
(`trusted_proxies`, `--trusted-proxy`): uvicorn then takes the client's address from
X-Forwarded-For (the rightmost one not itself a trusted proxy) and the scheme from
X-Forwarded-Proto, and the proxy's own connections are bound by max_connections alone. No proxy
is trusted by default: anyone could otherwise name any address and dodge every per-address count.

A TLS server's handshake is the protocol's own (`_begin_tls`), not asyncio's: asyncio
shakes hands before the protocol sees the connection, for up to 60 s, on ~300 KiB of buffers
each, with no count by address, so 2,000 idle TCP connections from one host took 600 MiB of a
node in two seconds (a security probe) and none of them could be seen. Now one address has at
most `max_tls_handshakes_per_address` in progress (one more is reset at once), each for at most
`tls_handshake_timeout_s`; past `max_tls_handshakes` in all, a newcomer resets the oldest
handshake of the address holding the most, not itself (refusing newcomers let 32 addresses
lock every new client out: review), so a real handshake, done in milliseconds, gets through.
asyncio's TLS read buffer is 32 KiB, not 256 (a TLS record is at most ~16.6 KiB), and a TLS
connection closes within `tls_shutdown_timeout_s` of its close, not asyncio's 30 s. A handshake
that fails (no client certificate, an unknown CA, not TLS) or runs out of time is counted and
logged with the peer's address.

Every connection closed for one of these reasons is counted (`ConnectionRefusals`, on /metrics as
kvfence_http_connections_refused_total) and logged at most once per reason and address every
ten seconds: a client hammering its cap would otherwise write a log line per attempt.
"""
from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import errno
import fcntl
import ipaddress
import json
import logging
import socket
import ssl
import struct
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import h11
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvfence.http")

CAP_BODY = json.dumps({"error": {"message": "The server has too many open connections; retry shortly.",
                                 "type": "server_error", "param": None, "code": "server_overloaded"}}).encode()
ADDRESS_CAP_BODY = json.dumps({"error": {
    "message": "Too many open connections from your address; close some or retry shortly.",
    "type": "server_error", "param": None, "code": "server_overloaded"}}).encode()


async def _over_the_cap(scope: Any, receive: Any, send: Any) -> None:
    """uvicorn's answer past limit_concurrency, in the API's own error shape with Retry-After
    (uvicorn's is a bare text/plain 503, which clients can only guess at)."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(CAP_BODY)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": CAP_BODY, "more_body": False})


# the h11 protocol looks the 503 app up in its module at each refusal; every uvicorn server in
# a kvfence process is built by uvicorn_server() with this protocol, so the swap is ours alone
if not hasattr(h11_impl, "service_unavailable"):   # a uvicorn that renamed it would silently keep its own
    raise ImportError("uvicorn's h11 protocol has no service_unavailable hook; kvfence needs a uvicorn that does")
h11_impl.service_unavailable = _over_the_cap

# asyncio gives each TLS connection a read buffer of 256 KiB at once, handshake or not: 1,000
# idle ones cost 300 MiB (review). A TLS record is at most ~16.6 KiB, so 32 KiB reads lose nothing.
TLS_READ_BUFFER = 32 << 10
asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BUFFER


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0       # an 8 MiB body needs ~140 KB/s to make it
    send_timeout_s: float = 60.0       # an answer's bytes not taken by the client (nginx's send_timeout)
    max_connections: int = 2048        # beyond this uvicorn answers 503 at once
    max_header_bytes: int = 64 << 10   # request line + headers; larger gets 400
    max_connections_per_address: int | None = None   # None: half of max_connections
    trusted_proxies: tuple[str, ...] = ()   # networks whose X-Forwarded-For/-Proto are believed
    tls_handshake_timeout_s: float = 5.0      # a handshake takes milliseconds; asyncio allows 60 s
    tls_shutdown_timeout_s: float = 5.0       # for the peer's close_notify; asyncio waits 30 s
    max_tls_handshakes: int = 1024            # in progress at once (~60 KiB each)
    max_tls_handshakes_per_address: int = 32

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.send_timeout_s > 0):
            raise ValueError("HTTP read and send timeouts must be positive")
        if self.max_connections < 1 or self.max_header_bytes < 1024:
            raise ValueError("max_connections must be >= 1 and max_header_bytes >= 1024")
        if self.max_connections_per_address is not None and self.max_connections_per_address < 1:
            raise ValueError("max_connections_per_address must be >= 1")
        if not (self.tls_handshake_timeout_s > 0 and self.tls_shutdown_timeout_s > 0 and self.max_tls_handshakes >= 1
                and self.max_tls_handshakes_per_address >= 1):
            raise ValueError("the TLS handshake timeout and caps must be positive")
        self.proxy_networks   # noqa: B018 - a wrong --trusted-proxy is refused here, at start

    @property
    def per_address(self) -> int:
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        return max(1, self.max_connections // 2)

    @cached_property
    def proxy_networks(self) -> tuple[IPNetwork, ...]:
        return tuple(_proxy_network(p) for p in self.trusted_proxies)

    def is_trusted_proxy(self, address: str) -> bool:
        networks = self.proxy_networks
        if not networks:
            return False
        ip = peer_ip(address)
        return ip is not None and any(ip in n for n in networks)

    def forwarded_allow_ips(self) -> list[str]:
        """The networks as uvicorn compares them, an IPv4 one also in its IPv4-mapped IPv6 form
        (how an IPv4 peer of a server on "::" appears)."""
        out = []
        for n in self.proxy_networks:
            out.append(str(n))
            if isinstance(n, ipaddress.IPv4Network):
                out.append(f"::ffff:{n.network_address}/{96 + n.prefixlen}")
        return out


def for_role(role: str, header_timeout_s: float, body_timeout_s: float, max_connections: int,
             per_address: int | None, trusted_proxies: tuple[str, ...] = (),
             send_timeout_s: float = HttpLimits.send_timeout_s) -> HttpLimits:
    """A role's limits from its flags. A prefill or decode node's clients are its routers, each
    with its pool of connections: one address may hold all of them, and shake hands for as many
    at once (a cold pool, or a node back from a restart; 32 at a time reset the router's burst,
    and with one node of a role its requests failed: review)."""
    node = role in ("prefill", "decode")
    if node and trusted_proxies:
        raise ValueError("--trusted-proxy is for the single node and the router: a prefill or decode node "
                         "is reached by routers only, each counted by its own address")
    if per_address is None and node:
        per_address = max_connections
    return HttpLimits(header_timeout_s, body_timeout_s, send_timeout_s, max_connections,
                      max_connections_per_address=per_address, trusted_proxies=trusted_proxies,
                      **({"max_tls_handshakes_per_address": HttpLimits.max_tls_handshakes} if node else {}))


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def peer_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A peer's address as an IP, an IPv4-mapped IPv6 one as its IPv4 address (how an IPv4
    client of a server listening on "::" appears), or None when it is no IP."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def address_group(host: str) -> str:
    """What one client is counted as (wrong keys, open connections): an IPv4 address (an
    IPv4-mapped IPv6 one too), an IPv6 address's /64 (one host commonly has all of it), or
    the host string as given when it is no address."""
    ip = peer_ip(host)
    if ip is None:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _proxy_network(text: str) -> IPNetwork:
    """One --trusted-proxy value as a network. No wildcard and no host names: whoever sits in a
    trusted network may name any client address, so the operator lists the proxy's own."""
    try:
        network = ipaddress.ip_network(text.strip())   # strict: 10.0.0.7/8 is a typo, not 10.0.0.0/8
    except ValueError:
        raise ValueError(f"trusted proxy {text!r} is not an IP address or network (e.g. 10.0.0.7 or "
                         "10.0.0.0/24, host bits zero): name the proxy's own addresses; '*' and host names "
                         "are not accepted") from None
    if network.prefixlen == 0:
        raise ValueError(f"trusted proxy {text!r} is every address: name the proxy's own addresses")
    return network


REFUSAL_REASONS = ("per_address_cap", "header_timeout", "body_timeout", "send_timeout", "tls_handshakes_in_progress",
                   "tls_handshake_failed")


class ConnectionRefusals:
    """Connections a server closed without serving them, by reason (for /metrics), and their
    log lines: the first per (reason, address), then at most one every `quiet_s` that says how
    many it stood for. Addresses remembered are bounded (the oldest are forgotten first)."""

    def __init__(self, quiet_s: float = 10.0, max_addresses: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.quiet_s, self.max_addresses, self.clock = quiet_s, max_addresses, clock
        self.counts = dict.fromkeys(REFUSAL_REASONS, 0)
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}   # key -> (logged at, not logged since)

    def note(self, reason: str, address: str | None, message: str, *args: Any) -> None:
        self.counts[reason] += 1
        key, now = (reason, address or "-"), self.clock()
        last = self._logged.get(key)
        if last is not None and now - last[0] < self.quiet_s:
            self._logged[key] = (last[0], last[1] + 1)
            return
        if last is not None and last[1]:
            message += f" (and {last[1]} more like it in the {now - last[0]:.0f} s before)"
        log.warning(message, *args)
        self._logged.pop(key, None)
        if len(self._logged) >= self.max_addresses:
            self._logged = {k: v for k, v in self._logged.items() if now - v[0] < self.quiet_s}
            while len(self._logged) >= self.max_addresses:
                del self._logged[next(iter(self._logged))]
        self._logged[key] = (now, 0)


def uvicorn_kwargs(limits: HttpLimits, refusals: ConnectionRefusals | None = None) -> dict[str, Any]:
    """The options of uvicorn.Config that enforce `limits` (pass them with the app's own);
    `refusals` counts the connections they close (the server's metrics read it)."""
    return {"http": _protocol_for(limits, refusals or ConnectionRefusals()),
            # no WebSocket route exists, and an upgraded connection leaves the guarded protocol
            # without its connection_lost: each one left its address a place held for good (review)
            "ws": "none",
            "limit_concurrency": limits.max_connections, "h11_max_incomplete_event_size": limits.max_header_bytes,
            # uvicorn would take X-Forwarded-For from a loopback peer as the client's address;
            # every per-address bound (wrong keys, connections) must count the real peer, unless
            # the operator named the proxy in front (its clients all share its address)
            **({"proxy_headers": True, "forwarded_allow_ips": limits.forwarded_allow_ips()}
               if limits.trusted_proxies else {"proxy_headers": False})}


def _protocol_for(limits: HttpLimits, refusals: ConnectionRefusals) -> type[H11Protocol]:
    # uvicorn builds the protocol itself, so the limits (and the server's count of connections
    # per address) travel as class attributes, one class per server
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "by_address": {},
                                                              "refusals": refusals, "handshaking": {}})


Handshakes = dict[str, dict["GuardedH11Protocol", asyncio.Transport]]   # address -> in progress, oldest first


class GuardedH11Protocol(H11Protocol):
    limits = HttpLimits()
    by_address: dict[str, int] = {}    # open connections per client address (the event loop's only)
    refusals = ConnectionRefusals()
    tls: ssl.SSLContext | None = None   # the server's, set at its start-up: the handshake is ours
    handshaking: Handshakes = {}        # TLS handshakes in progress per client address
    CHECK_EVERY_S = 1.0
    LINGER_S = 2.0
    _watchdog: asyncio.TimerHandle | None = None
    _address: str | None = None
    _handshake_group: str | None = None   # set while this connection's handshake runs
    _unread_since: float | None = None    # since when written bytes wait for the client (_unread_for)
    _taken: tuple[int, ...] = ()          # what the client had taken at the last check (_unread_for)

    def connection_made(self, transport: asyncio.Transport) -> None:
        if self.tls is not None and transport.get_extra_info("sslcontext") is None:
            self._begin_tls(transport)
            return
        super().connection_made(transport)
        self._discarding = False
        self._began = False          # bytes of the current request have arrived
        self._served = False         # a response went out on it: silence after that is an idle keep-alive
        self._phase: object = h11.IDLE
        self._phase_since = self.loop.time()
        self._watchdog: asyncio.TimerHandle | None = None
        address = _peer_address(transport)
        # a trusted proxy carries many clients' connections: only the server's total binds it,
        # and they are not counted against its neighbours' /64 either (review)
        if address is not None and self.limits.is_trusted_proxy(address):
            address = None
        # counted by address_group: an IPv6 host has a /64 of addresses to connect from (probe)
        self._address = address_group(address) if address is not None else None
        if self._address is not None:
            held = self.by_address.get(self._address, 0) + 1
            self.by_address[self._address] = held
            if held > self.limits.per_address:
                self.refusals.note("per_address_cap", self._address,
                                   "refusing a connection from %s: it holds %d (at most %d per address)",
                                   self._address, held - 1, self.limits.per_address)
                self._refuse_connection()
                return
        self._watchdog = self.loop.call_later(self.CHECK_EVERY_S, self._check_deadlines)

    def _begin_tls(self, raw: asyncio.Transport) -> None:
        """A TLS connection before its handshake: within the caps, shake hands (bounded in time),
        then serve it as any other; else reset it."""
        raw.pause_reading()   # no byte of it reaches h11 before the handshake
        address = _peer_address(raw)
        proxy = address is not None and self.limits.is_trusted_proxy(address)
        group = address_group(address) if address is not None else "-"
        pending = self.handshaking
        mine = pending.get(group, {})
        if not proxy and len(mine) >= self.limits.max_tls_handshakes_per_address:
            self.refusals.note("tls_handshakes_in_progress", group, "refusing a connection from %s: %d TLS handshakes "
                               "from it in progress (at most %d per address)", group, len(mine),
                               self.limits.max_tls_handshakes_per_address)
            raw.abort()
            return
        if sum(len(v) for v in pending.values()) >= self.limits.max_tls_handshakes:
            # full: the address holding the most gives up its oldest (the newcomer is as likely
            # the router as anyone, and its handshake takes milliseconds)
            most = max(pending, key=lambda g: len(pending[g]))
            victim, victim_raw = next(iter(pending[most].items()))
            self.refusals.note("tls_handshakes_in_progress", most, "resetting a TLS handshake from %s: %d in progress "
                               "in all (at most %d), %d of them from it", most, self.limits.max_tls_handshakes,
                               self.limits.max_tls_handshakes, len(pending[most]))
            victim._end_handshake()
            victim_raw.abort()
        pending.setdefault(group, {})[self] = raw
        self._handshake_group = group
        self._early: list[bytes] = []   # what came with the handshake's last flight (a request)
        task = self.loop.create_task(self._shake_hands(raw, group))
        task.add_done_callback(lambda t: self._handshake_done(t, raw))

    async def _shake_hands(self, raw: asyncio.Transport, group: str) -> None:
        assert self.tls is not None
        try:
            tls = await self.loop.start_tls(raw, self, self.tls, server_side=True,
                                            ssl_handshake_timeout=self.limits.tls_handshake_timeout_s,
                                            ssl_shutdown_timeout=self.limits.tls_shutdown_timeout_s)
        except OSError as e:   # start_tls closed the connection (ssl errors, resets, the deadline)
            why = _handshake_failure(e, self.limits.tls_handshake_timeout_s)
            if why is not None and self._handshake_group is not None:   # not one reset for the cap
                self.refusals.note("tls_handshake_failed", group, "closing the connection from %s: TLS handshake "
                                   "failed (%s)", _peer_address(raw) or group, why)
            return
        finally:
            # now, before the connection is served (its first answer may go out before the task's
            # done callback runs); _handshake_done repeats it for a task that never got here
            self._end_handshake()
        if tls is None or tls.is_closing():
            return
        self.connection_made(tls)   # now with its TLS transport: the caps and deadlines of any other
        early, self._early = self._early, []
        for chunk in early:
            self.data_received(chunk)

    def _handshake_done(self, task: asyncio.Task, raw: asyncio.Transport) -> None:
        """Also for a task cancelled before it ran (shutdown): its count and its socket go."""
        self._end_handshake()
        if task.cancelled():
            raw.abort()
        elif (e := task.exception()) is not None:   # not an OSError: a bug, not a client
            log.error("TLS handshake task failed: %r", e)
            raw.abort()

    def _end_handshake(self) -> None:
        group, self._handshake_group = self._handshake_group, None
        if group is None:
            return
        mine = self.handshaking.get(group)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del self.handshaking[group]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return   # lost in its TLS handshake (_shake_hands counts it): uvicorn never had it
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._address is not None:
            left = self.by_address.get(self._address, 1) - 1
            if left > 0:
                self.by_address[self._address] = left
            else:
                self.by_address.pop(self._address, None)
            self._address = None
        super().connection_lost(exc)

    def _refuse_connection(self) -> None:
        """503 before the request is read (written raw: h11 frames no response before one),
        then a lingering close, as _give_up does."""
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                             b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(ADDRESS_CAP_BODY), ADDRESS_CAP_BODY))
        self._linger_close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._phase, self._phase_since = h11.IDLE, self.loop.time()   # the next request's header clock
        self._began = False
        self._served = True

    def _unread_for(self, now: float) -> float:
        """How long bytes have waited for this connection's client with none of them taken.

        Waiting: bytes in asyncio's buffer or the kernel's send queue (under TLS also in
        asyncio's buffer of the encrypted bytes, which keeps the kernel's queue full). Taken:
        the client's TCP acknowledged more (TCP_INFO's bytes acked), so a slow reader that keeps
        reading is never cut, and an open connection is watched as a paused or closed one is (a
        client that keeps asking and never reads; a TLS client that half-closed: review).
        Where the system cannot say, only a paused or closing connection is watched, and a
        buffer or queue that shrank counts as taken (while the app may write, one can stay level
        as the client reads)."""
        buffered, queued = self.transport.get_write_buffer_size(), _kernel_queued(self.transport)
        acked = _kernel_acked(self.transport) if buffered or queued else None   # a syscall saved when idle
        mark: tuple[int, ...]
        if acked is not None:
            waiting, mark = buffered > 0 or queued > 0, (acked,)
        else:
            waiting = self.flow.write_paused or (self.transport.is_closing() and buffered > 0)
            mark = (-buffered, -queued)
        if not waiting:
            self._unread_since = None
            return 0.0
        if self._unread_since is None or any(m > last for m, last in zip(mark, self._taken)):
            self._unread_since = now
        self._taken = mark
        return now - self._unread_since

    def _check_deadlines(self) -> None:
        self._watchdog = None
        now = self.loop.time()
        waited = self._unread_for(now)
        if waited > self.limits.send_timeout_s:
            self._reset_unread(waited)
            return
        if self.transport.is_closing() or self._discarding:
            # closed or about to be: only its unsent bytes are watched, until sent or reset
            if self._unread_since is not None or not self.transport.is_closing():
                self._watchdog = self.loop.call_later(self.CHECK_EVERY_S, self._check_deadlines)
            return
        state = self.conn.their_state
        if state is not self._phase:
            if state is h11.SEND_BODY or (state is h11.IDLE and self._phase is not h11.IDLE):
                self._phase_since = now
            self._phase = state
        waited = now - self._phase_since
        if state is h11.IDLE and self.conn.our_state is h11.IDLE and waited > self.limits.header_timeout_s:
            # a 408 only to a client that began a request: on a silent kept-alive connection it
            # could race the client's next request and be read as its answer
            idle = self._served and not self._began   # an ordinary idle keep-alive: not a refusal
            self._give_up(None if idle else "header_timeout", "request headers", waited, answer_408=self._began)
            return
        if state is h11.SEND_BODY and waited > self.limits.body_timeout_s:
            self._give_up("body_timeout", "request body", waited,
                          answer_408=self.cycle is None or not self.cycle.response_started)
            return
        self._watchdog = self.loop.call_later(self.CHECK_EVERY_S, self._check_deadlines)

    def _reset_unread(self, waited: float) -> None:
        """Reset a connection whose client took none of its answer's bytes for the send deadline:
        they cannot be delivered, and a close would wait for them (a slow-read attack holds
        memory and connection places that way for good)."""
        self._note_refusal("send_timeout", "resetting the connection from %s: it took none of %d bytes of its "
                           "answer in %.0f s", self._client_text(),
                           self.transport.get_write_buffer_size() + _kernel_queued(self.transport), waited)
        self._tell_app_gone()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # a reset, not a close: abort() drops only asyncio's buffer, and the kernel would go on
            # offering what it holds (megabytes a socket) to the client that reads nothing
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _give_up(self, reason: str | None, what: str, waited: float, answer_408: bool) -> None:
        """Close the connection; `reason` counts and logs it as refused (None: an idle close)."""
        client = self._client_text()
        if reason is None:
            log.debug("closing the connection from %s: idle for %.0f s", client, waited)
        else:
            self._note_refusal(reason, "closing the connection from %s: its %s did not arrive within %.0f s", client,
                               what, waited)
        if answer_408:
            # written raw: h11 frames no response before a request, and the app's own response,
            # if it tries one later, is dropped because the cycle is marked disconnected
            body = f"{what} not received in time\n".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self._tell_app_gone()
        self._linger_close()

    def _tell_app_gone(self) -> None:
        """The app's receive() returns http.disconnect (it frees what the request held), and a
        response it tries later is dropped."""
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _client_text(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _note_refusal(self, reason: str, message: str, *args: Any) -> None:
        self.refusals.note(reason, self.client[0] if self.client else None, message, *args)

    def _linger_close(self) -> None:
        # a lingering close: closing with the client's bytes still arriving makes the kernel send
        # a reset, which can destroy the answer before the client reads it
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.LINGER_S, self.transport.close)
        if self._watchdog is None:   # the close waits for unsent bytes: _check_deadlines bounds that
            self._watchdog = self.loop.call_later(self.CHECK_EVERY_S, self._check_deadlines)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            # the TLS layer hands the request on as the handshake completes, before _shake_hands
            # resumes to make the connection: keep it for then
            self._early.append(data)
            return
        if self._discarding:
            return
        self._began = True
        super().data_received(data)


def _peer_address(transport: asyncio.BaseTransport) -> str | None:
    """The client's address as the socket has it (None: a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else None


def _kernel_queued(transport: asyncio.BaseTransport) -> int:
    """Bytes in the send queue of the transport's socket (0 where the system cannot say)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]   # SIOCOUTQ
    return 0


def _kernel_acked(transport: asyncio.BaseTransport) -> int | None:
    """Bytes the socket's peer has acknowledged so far (None where the system cannot say)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and _LINUX_TCP_INFO:
        with contextlib.suppress(OSError):
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= 128:   # Linux 4.1 and later
                return struct.unpack_from("Q", info, 120)[0]   # struct tcp_info's tcpi_bytes_acked
    return None


_LINUX_TCP_INFO = sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


def _handshake_failure(e: BaseException, timeout_s: float) -> str | None:
    """Why a TLS handshake failed, in words for the log; None for a peer that only closed its
    connection before it was done (a port check, a client that gave up): not a refusal."""
    if isinstance(e, ssl.SSLError):
        return {"PEER_DID_NOT_RETURN_A_CERTIFICATE": "no client certificate",
                "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust this server's CA",
                "CERTIFICATE_VERIFY_FAILED": "a client certificate this server's CA did not sign",
                "HTTP_REQUEST": "plain HTTP sent to the TLS port",
                "WRONG_VERSION_NUMBER": "not TLS"}.get(e.reason or "", e.reason or str(e))[:200]
    if isinstance(e, ConnectionAbortedError):   # how asyncio ends a handshake past its deadline
        return f"not done within {timeout_s:g} s"
    return None


def uvicorn_server(app: Any, host: str, port: int, limits: HttpLimits, log_level: str = "info",
                   access_log: bool = False, refusals: ConnectionRefusals | None = None,
                   listening: Callable[[str, int], None] | None = None, **options: Any):
    """The one way kvfence builds its uvicorn servers, so that no role runs without the limits.
    listening(scheme, port) is called once the socket is bound, with the port the system chose
    for --port 0, so that a role's "serving on" line names the address a client can use."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            # the listener gets no TLS context: the protocol shakes hands itself, within its
            # caps and deadline (GuardedH11Protocol._begin_tls)
            context, self.config.ssl = self.config.ssl, None
            self.config.http_protocol_class.tls = context
            try:
                await super().startup(sockets)
            finally:
                self.config.ssl = context
            if listening is not None and self.started and self.servers:
                bound = self.servers[0].sockets[0].getsockname()[1]
                listening("https" if self.config.is_ssl else "http", bound)

        def _log_started_message(self, listeners) -> None:
            self.config.ssl = self.config.http_protocol_class.tls   # "running on https://": it is TLS
            super()._log_started_message(listeners)

    if limits.trusted_proxies:
        log.info("X-Forwarded-For and X-Forwarded-Proto are believed from %s only",
                 ", ".join(str(n) for n in limits.proxy_networks))
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                 **uvicorn_kwargs(limits, refusals), **options))


def port_unavailable(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on now (taken, or not this machine's address), or
    None. Checked before the model loads: uvicorn binds only once the server starts, after
    minutes of loading with a large model, and a taken port was found only then. Every address
    the name resolves to is tried as uvicorn's server binds them (SO_REUSEADDR; IPv6 only on an
    IPv6 socket; a family this host cannot open skipped), each socket closed at once; a race
    with another process remains."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    bound = 0
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        try:
            s = socket.socket(family, kind, proto)
        except OSError:   # e.g. IPv6 listed for the name but off on this host: uvicorn skips it too
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                why = "it is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
                return f"cannot listen on {host}:{port} ({addr[0]}): {why}"
        bound += 1
    return None if bound else f"cannot listen on {host}:{port}: no address of it can be opened here"
