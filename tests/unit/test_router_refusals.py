"""What the PD router refuses before it contacts any node."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvfence.engine.params import SamplingParams
from kvfence.pd.router import RouterBackend


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=0), SamplingParams(max_tokens=4, prompt_logprobs=1)])
def test_prompt_scoring_is_refused_behind_the_router(params):
    """Prefill samples nothing and decode never computes the prompt: neither can score it, and
    a request for no tokens has nothing for decode to do (a 400 in server/app.py)."""
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._ready, router.facts = True, {"usable_context": 1024}
    router.fleet = SimpleNamespace(ready=True)   # a stand-in: no node is contacted before these refusals
    with pytest.raises(ValueError, match="not supported behind the PD router"):
        asyncio.run(router.submit([1, 2, 3], params, "alice"))
    assert not router._tasks


def test_a_request_the_wire_cannot_carry_ends_instead_of_hanging(monkeypatch):
    """Found in review: WireParams.of ran before the request task's try, so when it raised the
    task died, `admitted` was never set and submit() waited forever, holding the tenant's slot.
    Any failure there must end the request (the API now refuses such params itself: below)."""
    from kvfence.pd import router as router_mod

    def refuse(p):
        raise ValueError("the wire refuses these params")

    monkeypatch.setattr(router_mod.WireParams, "of", staticmethod(refuse))
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._ready, router.facts = True, {"usable_context": 1024}
    router.fleet = SimpleNamespace(ready=True)   # a stand-in: no node is contacted before these refusals

    async def go():
        return await asyncio.wait_for(router.submit([1, 2, 3], SamplingParams(max_tokens=4), "alice"), 10)

    with pytest.raises(Exception, match="wire refuses") as e:
        asyncio.run(go())
    assert not isinstance(e.value, TimeoutError)


def test_what_a_single_node_accepts_the_wire_carries():
    """The stop bounds live in engine/params.py and the wire takes them from there: at the
    bound SamplingParams crosses the wire, past it SamplingParams (so the API) refuses."""
    from kvfence.engine.params import MAX_STOP_CHARS, MAX_STOP_TOKEN_ID, MAX_STOP_TOKEN_IDS
    from kvfence.pd.messages import WireParams

    at = SamplingParams(stop=["x" * MAX_STOP_CHARS] * 16, stop_token_ids=[MAX_STOP_TOKEN_ID] * MAX_STOP_TOKEN_IDS)
    assert WireParams.from_json(WireParams.of(at).to_json()).to_params() == at
    for past in (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), dict(stop_token_ids=[MAX_STOP_TOKEN_ID + 1]),
                 dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(**past)


@pytest.mark.parametrize("code,retryable", [("server_overloaded", True), ("not_ready", True), ("draining", True),
                                            ("engine_unavailable", True),
                                            ("context_length_exceeded", False), ("invalid_request", False)])
def test_a_refusal_in_the_stream_is_retryable_as_one_in_the_status(code, retryable):
    """Found in review: nodes refuse inside a 200 stream, and that refusal never said
    retryable, so a decode node refusing for load failed the request although another decode
    node could take it (may_retry_decode needs retryable). The same codes as an HTTP refusal."""
    from kvfence.pd.messages import RejectedEvent
    from kvfence.pd.router import NodeError, may_retry_decode

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)

    async def events():
        yield RejectedEvent(code=code, message="no")

    with pytest.raises(NodeError) as e:
        asyncio.run(router._admitted("decode", events()))
    assert e.value.retryable is retryable
    assert may_retry_decode(e.value.code, e.value.retryable, admitted=False, tried=0) is retryable


def test_a_forget_message_goes_stamped_to_checked_nodes_only():
    """A node this router process never checked was never sent one of its requests, so it
    holds none of its scopes (a node keeps each router's apart): no message. It used to get an
    unstamped one, which retired the name's plain scope instead. Mutant: no such skip."""
    import json

    from kvfence.pd.messages import ForgetTenantsReply

    sent = []

    class Client:
        async def post(self, url, content=None, headers=None, **kw):
            sent.append((url, json.loads(content)))
            return SimpleNamespace(status_code=200, content=ForgetTenantsReply(pages=3).dumps())

    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)
    router._client = Client()
    checked = SimpleNamespace(url="http://checked", role="prefill", address=None,
                              info=SimpleNamespace(scope_stamps=True))
    never = SimpleNamespace(url="http://never", role="decode", address=None, info=None)
    router.fleet = SimpleNamespace(nodes=[checked, never])
    assert asyncio.run(router.forget_tenants(["carol"], 2)) == 3
    assert sent == [("http://checked/internal/forget_tenants",
                     {"tenants": ["carol"], "router": router.router_id, "epoch": 2})]


def test_a_decode_node_that_took_the_connection_and_died_may_still_pull():
    """A decode node killed (or stopped) after the router's request went out was reported
    'unreachable: ReadError: .' with node_unavailable, which the docs promise for a node never
    reached (found by a fleet probe). Now node_failed, with the kind of break named. What I6
    needs of it: such a node may have taken the handoff and be pulling, so the request's
    prefill rows are not taken as unread (reader_stopped stays False: prefill fences them);
    a port nobody listens on is node_unavailable, retryable, and surely never pulls."""
    import socket
    import threading

    from kvfence.pd.fleet import Node
    from kvfence.pd.messages import ReleaseBody
    from kvfence.pd.router import NodeError, _Flight

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def take_and_drop() -> None:   # reads the request, then goes away without a word
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")   # RST
        conn.close()

    threading.Thread(target=take_and_drop, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    router = RouterBackend(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{nobody}", b"k" * 32)

    async def attempt(url: str) -> tuple[NodeError, _Flight]:
        flight = _Flight("r1", "r1")
        admitted = asyncio.get_running_loop().create_future()
        with pytest.raises(NodeError) as e:   # any message body will do: it fails before one is read
            await router._decode(ReleaseBody(request_id="r1"), flight, None, admitted, 4, Node("decode", url))
        return e.value, flight

    async def both():
        try:
            return await attempt(f"http://127.0.0.1:{port}"), await attempt(f"http://127.0.0.1:{nobody}")
        finally:
            await router._http().aclose()

    (died, after_death), (never, after_refusal) = asyncio.run(both())
    listener.close()
    assert died.code == "node_failed" and not died.retryable, died
    assert str(died).startswith("the decode node failed before answering: ReadError"), died
    assert not after_death.reader_stopped and after_death.decode_contacted   # it may be pulling
    assert never.code == "node_unavailable" and never.retryable, never
    assert after_refusal.reader_stopped   # never reached: it never pulls


@pytest.mark.parametrize("raised, code, retryable, maybe_taken", [
    ("ConnectTimeout", "node_unavailable", True, False),   # no byte of the request went out
    ("PoolTimeout", "server_overloaded", False, False),    # the router's own connections are all taken
    ("ReadTimeout", "node_failed", False, True),           # sent; the node hangs
])
def test_timeouts_are_told_apart_by_what_reached_the_node(raised, code, retryable, maybe_taken):
    """Review: a connect timeout (a vanished pod) was taken for a node that died holding the
    request, and the router's own full connection pool was blamed on the node."""
    import httpx

    from kvfence.pd.fleet import Node
    from kvfence.pd.messages import ReleaseBody
    from kvfence.pd.router import NodeError

    def transport(request: httpx.Request) -> httpx.Response:
        raise getattr(httpx, raised)("timed out", request=request)

    router = RouterBackend("http://p", "http://d", b"k" * 32)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(transport))

    async def go() -> NodeError:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            with pytest.raises(NodeError) as e:
                await router._open(Node("decode", "http://d"), "/internal/release", ReleaseBody(request_id="r"), stack)
        await router._client.aclose()
        return e.value

    e = asyncio.run(go())
    assert (e.code, e.retryable, e.maybe_taken) == (code, retryable, maybe_taken), e


@pytest.mark.parametrize("after, message, admit", [
    (after, message, admit) for after, message in [
        ("break", "the decode node's stream broke off: ReadError"),
        ("silence", "the decode node sent nothing for 0.3 s, not even its heartbeat"),
        ("garbage", "the decode node sent malformed node event")] for admit in (True, False)] + [
    # well formed, out of order (after admission a kv_verified event is in order)
    ("unexpected", "decode node: expected admitted, got kv_verified", False)])
def test_a_decode_stream_that_fails_is_named_and_may_still_pull(after, message, admit):
    """A node killed mid-stream reached the client as "a PD node failed mid-request:
    RemoteProtocolError: ..." and a stalled one as "...: ReadTimeout", naming neither the node's
    role nor --node-stall. Before or after its admitted event, the decode node may be pulling
    the prefill rows, so the request's rows are not taken as unread (I6): reader_stopped stays
    False and prefill fences them."""
    import httpx

    from kvfence.pd.fleet import Node
    from kvfence.pd.messages import AdmittedEvent, DecodeBody, event_line
    from kvfence.pd.router import NodeError, _Flight

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            if admit:
                yield event_line(AdmittedEvent(prompt_tokens=4, max_tokens=4))
            if after == "break":
                raise httpx.ReadError("")
            if after == "silence":   # what a real client raises after --node-stall without a byte
                raise httpx.ReadTimeout("")
            if after == "unexpected":
                yield b'{"event": "kv_verified"}\n'
            yield b'{"event": "kv_verified", "extra": 1}\n'

    def transport(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Stream())

    router = RouterBackend("http://p", "http://d", b"k" * 32, stall_s=0.3)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(transport))

    async def go():
        flight = _Flight("r1", "r1")
        admitted = asyncio.get_running_loop().create_future()
        handle = SimpleNamespace(updates=asyncio.Queue())
        body = DecodeBody(request_id="r1", tenant="t", prompt_ids=[1, 2, 3, 4], params=_wire_params_of_4(),
                          handoff=None)
        with pytest.raises(NodeError) as e:
            await router._decode(body, flight, handle, admitted, 4, Node("decode", "http://d"))
        await router._client.aclose()
        return e.value, flight

    e, flight = asyncio.run(go())
    assert str(e).startswith(message), e
    # what I6 needs: before admission only maybe_taken keeps reader_stopped False (after it,
    # nothing sets reader_stopped but a kv_failed event saying so)
    assert e.code in ("node_failed", "node_error") and e.maybe_taken, e
    assert not flight.reader_stopped and flight.decode_contacted
    assert e.culprit == "decode"   # a redo of the whole request skips this node (may_redo)


@pytest.mark.parametrize("code, culprit", [("kv_transfer_failed", "transfer"), ("kv_transfer_timeout", None),
                                           ("lease_expired", None), ("kv_verification_failed", None),
                                           ("context_length_exceeded", None)])
@pytest.mark.parametrize("as_failed_event", [True, False])
def test_decode_blames_the_transfer_only_for_a_read_that_failed(code, culprit, as_failed_event):
    """A read of the rows that failed is either end's fault (the prefill node gone, or decode's
    own transfer engine): a redo skips each end that has another node (nodes_to_avoid). A lease
    that ran out and a pull slower than decode's give-up (load: a redo doubles the work where
    capacity is short), and KV that failed verification (I10: tampering is reported, not routed
    around) blame no node."""
    import httpx

    from kvfence.pd.fleet import Node
    from kvfence.pd.messages import (
        AdmittedEvent,
        DecodeBody,
        FailedEvent,
        Handoff,
        Manifest,
        ProgressEvent,
        TransferSource,
        event_line,
    )
    from kvfence.pd.router import NodeError, _Flight

    ended = (FailedEvent(error="no", abort_code=code) if as_failed_event else
             ProgressEvent(event="kv_failed", finished=True, finish_reason="aborted", error="no", abort_code=code))

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield event_line(AdmittedEvent(prompt_tokens=4, max_tokens=4))
            yield event_line(ended)

    router = RouterBackend("http://p", "http://d", b"k" * 32)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=Stream())))

    m = Manifest(request_id="r1", tenant="t", token_count=4, page_count=1, page_size=16, epochs=[0],
                 fingerprint="f", layout="l", boot_id="b", seal_salt="0" * 32, seal_key="ab" * 8, slot_bytes=1,
                 slots=[1], lease_deadline=1.0)
    handoff = Handoff(manifest=m, source=TransferSource(session="s:1", base=0, boot_id="b"))

    async def go():
        admitted = asyncio.get_running_loop().create_future()
        body = DecodeBody(request_id="r1", tenant="t", prompt_ids=[1, 2, 3, 4], params=_wire_params_of_4(),
                          handoff=handoff)   # with KV to pull: nothing reaches the client before kv_verified
        with pytest.raises(NodeError) as e:
            await router._decode(body, _Flight("r1", "r1"), SimpleNamespace(updates=asyncio.Queue()), admitted, 4,
                                 Node("decode", "http://d"))
        await router._client.aclose()
        return e.value

    e = asyncio.run(go())
    assert (e.code, e.culprit) == (code, culprit), e


@pytest.mark.parametrize("culprit, ready, avoid", [
    ("decode", {"P1", "D1", "D2"}, {"decode": {"D1"}}),
    ("decode", {"P1", "D1"}, None),                             # no other decode node: the 503
    ("prefill", {"P1", "P2", "D1"}, {"prefill": {"P1"}}),
    ("prefill", {"P1", "P2"}, None),                            # and no decode node at all
    ("transfer", {"P1", "P2", "D1", "D2"}, {"prefill": {"P1"}, "decode": {"D1"}}),   # either end: both
    ("transfer", {"P1", "D1", "D2"}, {"decode": {"D1"}}),      # the end that has another
    ("transfer", {"P1", "D1"}, None),                          # one node per role: as before
])
def test_a_redo_skips_the_failed_node_where_the_fleet_has_another(culprit, ready, avoid):
    from kvfence.pd.router import nodes_to_avoid

    def other(role, exclude):
        return any(n[0] == role[0].upper() and n not in exclude for n in ready)

    got = nodes_to_avoid(culprit, "P1", "D1", other)
    assert (None if got is None else {r: set(v) for r, v in got.items()}) == avoid


def test_a_request_is_redone_once_only_for_a_node_failure_before_its_client_saw_anything():
    from kvfence.pd.router import may_redo

    assert may_redo("prefill", holds_kv=True, answered=False, redone=False)
    assert may_redo("decode", holds_kv=True, answered=False, redone=False)
    assert not may_redo(None, holds_kv=True, answered=False, redone=False)        # the request's own failure
    assert not may_redo("decode", holds_kv=False, answered=False, redone=False)   # prefill's own retry applies
    assert not may_redo("decode", holds_kv=True, answered=True, redone=False)     # the client has tokens
    assert not may_redo("decode", holds_kv=True, answered=False, redone=True)     # once


def _wire_params_of_4():
    from kvfence.pd.messages import WireParams

    return WireParams.of(SamplingParams(max_tokens=4))


def test_a_nodes_overload_is_the_clients_503_in_the_nodes_words():
    """A node's waiting-share refusal names only the tenant's own count: the router relays it as
    a single node answers (Overloaded: 503 server_overloaded, Retry-After, outcome overloaded), not
    as an engine failure ("the operator's log has the details", counted as not_ready: a fairness
    probe). The router's own (its connections to the nodes) keeps its internals in the log."""
    from kvfence.engine.admission import Overloaded
    from kvfence.pd.messages import RejectedEvent
    from kvfence.pd.router import _as_submit_error

    words = ("The server is overloaded for this tenant: 8 of its requests are waiting, its share of the queue; "
             "retry shortly.")
    e = _as_submit_error("prefill node: " + words, "server_overloaded",
                         RejectedEvent(code="server_overloaded", message=words))
    assert isinstance(e, Overloaded) and str(e) == words
    own = _as_submit_error("no connection to the prefill node (256 in use)", "server_overloaded", None)
    assert isinstance(own, Overloaded) and "256" not in str(own)


def test_the_router_counts_each_tenants_requests_waiting_and_running():
    """kvfence_tenant_sequences on a PD router: a request waiting in prefill, for transfer rows or
    for decode's pages is in no node's scheduler (a fairness probe saw the prefill node report 0
    waiting while a light tenant's request sat there for 25 s); the router's own count shows it."""
    router = RouterBackend("http://127.0.0.1:9", "http://127.0.0.1:9", b"k" * 32)

    router._tenant_of.update({"a": ["heavy", True], "b": ["heavy", True], "c": ["light", False],
                              "d": ["heavy", False]})
    assert router.requests_by_tenant() == {"heavy": {"running": 2, "waiting": 1}, "light": {"running": 0, "waiting": 1}}
