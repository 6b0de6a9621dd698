"""A client that goes away aborts its request in the engine and every page comes back."""
from __future__ import annotations

import threading

import httpx
from server_harness import MODEL, pool_intact, wait_for

LONG = {"model": MODEL, "prompt": "Write a very long story about the sea:", "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True}


def test_burst_of_disconnects_returns_the_pool_to_baseline(server):
    base = server.wait_idle()
    assert pool_intact(base)
    gone_before = server.metric("kvfence_requests_total", tenant="alice", outcome="client_disconnected")
    aborted = threading.Barrier(9)

    def stream_then_leave(i: int):
        body = dict(LONG, stream=True) if i % 2 else dict(LONG, messages=[{"role": "user", "content": "A story?"}],
                                                          stream=True)
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        with server.http() as h, h.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]          # some tokens arrived: pages are held now
            assert any(g.startswith("data: ") for g in got)
            aborted.wait(30)                              # all of them are running at once, then leave
        # leaving the with-blocks closes the connection mid-stream

    def wait_then_leave(i: int):
        try:
            with server.http(timeout=httpx.Timeout(120, read=1.5)) as h:
                h.post("/v1/completions", json=LONG)
            raise AssertionError("a 1000-token request finished within the read timeout")
        except httpx.ReadTimeout:
            pass                                          # the client gave up and closed the connection
        aborted.wait(30)

    threads = [threading.Thread(target=stream_then_leave, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=wait_then_leave, args=(i,)) for i in range(3)]
    errors = []
    for t in threads:
        t.run = _catching(t.run, errors)
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # every request was aborted (not finished: 1000 tokens each would take minutes) and the
    # pool is exactly as it was
    after = server.wait_idle(30)
    assert after["running"] == 0 and after["waiting"] == 0
    # no page owned or quarantined; every page free or in the (reclaimable, tenant-scoped) prefix
    # cache, which may now also hold the aborted requests' computed prompt pages
    assert pool_intact(after)
    # ... and only the chat prompt's two full pages can have joined the cache: every page that
    # held generated tokens went back to the free list
    assert after["pages_shared"] - base["pages_shared"] <= 2
    assert after["pages_free"] >= base["pages_free"] - 2
    assert wait_for(lambda: server.metric("kvfence_requests_total", tenant="alice",
                                          outcome="client_disconnected") == gone_before + 9, 10)
    assert server.state.limiter.in_flight("alice") == 0
    # and the server goes on serving
    r = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens == 3


def _catching(run, errors):
    def wrapped():
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))
    return wrapped
