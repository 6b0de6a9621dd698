"""RouterBackend.end_all runs on the deadline thread while the event loop admits requests. A
request between submit's `closing` check and its task (found in review with a thread switch
there) was either cancelled before its first step, so submit waited forever, or, with nothing
else in flight, never ended at all. Both now end with server_shutting_down. A fake stands in
for the fleet and for a request in decode; the code under test is the real submit and _run."""
from __future__ import annotations

import asyncio
import threading

import pytest

import kvfence.pd.router as router
from kvfence.engine.params import SamplingParams
from kvfence.server.backend import EngineFailed


def _backend() -> router.RouterBackend:
    b = router.RouterBackend.__new__(router.RouterBackend)   # no nodes: only what submit reads
    b._ready, b.facts, b.router_id = True, {"usable_context": 1024}, "r"
    b.fleet = type("Fleet", (), {"ready": True})()
    b.closing, b._ending, b._loop, b._tasks, b._cancelled, b._background = None, {}, None, {}, set(), set()
    b._tenant_of, b._prompt_held = {}, {}
    return b


@pytest.mark.parametrize("another_in_flight", [True, False])
def test_a_request_submitted_as_the_deadline_passes_ends_with_the_shutdown_code(monkeypatch, another_in_flight):
    b = _backend()
    real_run = router.RouterBackend._run

    async def decoding(self, rid, *a):   # a request in decode until it is ended
        a[-1].set_result(None)
        await asyncio.sleep(3600)

    real_stamp = router.ScopeStamp

    def stamp(**kw):   # the deadline thread runs end_all right here, past submit's check
        t = threading.Thread(target=b.end_all, args=("server_shutting_down", "the deadline passed"))
        t.start()
        t.join()
        monkeypatch.setattr(router, "ScopeStamp", real_stamp)
        return real_stamp(**kw)

    async def main():   # the router's loop is known from the first submit on, before its check
        if another_in_flight:
            monkeypatch.setattr(b, "_run", decoding.__get__(b))
            await b.submit([1, 2, 3], SamplingParams(max_tokens=5), "alice", "A")
        monkeypatch.setattr(b, "_run", real_run.__get__(b))
        monkeypatch.setattr(router, "ScopeStamp", stamp)
        with pytest.raises(EngineFailed) as e:
            await asyncio.wait_for(b.submit([1, 2, 3], SamplingParams(max_tokens=5), "alice", "B"), 10)
        assert e.value.code == "server_shutting_down"
        with pytest.raises(EngineFailed):   # and what comes after is refused at once
            await b.submit([1, 2, 3], SamplingParams(max_tokens=5), "alice", "C")

    asyncio.run(main())


def test_a_request_still_in_prefill_ends_with_the_shutdown_code(monkeypatch):
    """Ended before decode admitted it, submit() itself raises (it waits on admission)."""
    b = _backend()

    async def prefilling(self, body, flight, scope):
        await asyncio.sleep(3600)

    monkeypatch.setattr(router.RouterBackend, "_prefill_on_some_node", prefilling)
    monkeypatch.setattr(router.RouterBackend, "_settle_prefill", lambda *a: asyncio.sleep(0), raising=False)

    async def main():
        b._loop = asyncio.get_running_loop()
        sub = asyncio.create_task(b.submit([1, 2, 3], SamplingParams(max_tokens=5), "alice", "P"))
        await asyncio.sleep(0.05)
        assert b.in_flight == 1 and not sub.done()
        threading.Thread(target=b.end_all, args=("server_shutting_down", "the deadline passed")).start()
        with pytest.raises(EngineFailed) as e:
            await asyncio.wait_for(sub, 10)
        assert e.value.code == "server_shutting_down" and "the deadline passed" in str(e.value)

    asyncio.run(main())
