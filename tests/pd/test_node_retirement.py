"""A prefill node's scope gate (pd/scope_epochs.py ScopeGate) on a real engine and the real
internal routes: a request queued behind a retirement of its scope that fails is refused,
not run in the scope it was to leave. Found in review: a request of the name's new party,
stamped with the forget message's own epoch, arrived while that message's retirement was
queued; the retirement raised, and the request attached the old party's cached prompt.
Fakes nothing but the raise (and an in-process transfer engine, which this path never uses)."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
from fastapi import FastAPI

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.pd.drain import Drain
from kvfence.pd.node import INTERNAL_PREFIX, add_internal_routes
from kvfence.pd.prefill import KvExporter
from kvfence.pd.seal import control_headers
from kvfence.pd.settings import PDSettings
from kvfence.pd.transfer import InProcessTransport
from kvfence.server.engine_loop import EngineLoop
from kvfence.server.errors import APIError

SECRET = b"node retirement test cluster secret, 32+ bytes"
PROMPT = list(range(300, 364))   # 64 tokens: several full pages the prefix cache keeps


def _node(loaded, fail: dict, admitted: list[str]) -> tuple[FastAPI, EngineLoop]:
    settings = PDSettings("prefill", cluster_secret=SECRET)

    def factory() -> LLMEngine:
        eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="32MiB", clamp_context=True,
                                     max_model_len=512, progress=False), loaded)
        KvExporter(eng, settings, InProcessTransport())
        forget = eng.forget_tenant

        def forget_tenant(tenant, router=None):
            if fail.get("retire"):
                raise RuntimeError("injected: the retirement raised")
            return forget(tenant, router)
        eng.forget_tenant = forget_tenant
        add = eng.add_request

        def add_request(prompt_ids, params, **kw):   # what the engine was given at all
            admitted.append(kw["request_id"])
            return add(prompt_ids, params, **kw)
        eng.add_request = add_request
        return eng

    loop = EngineLoop(factory).start()
    assert loop.wait_ready(120), loop.error
    app = FastAPI()
    app.add_exception_handler(APIError, lambda request, e: e.response())
    add_internal_routes(app, loop, settings, Drain(lambda: {}, lambda: None))
    return app, loop


def _prefill(rid: str, epoch: int) -> dict:
    return {"request_id": rid, "tenant": "bob", "prompt_ids": PROMPT, "params": {"max_tokens": 1},
            "scope": {"router": "r1", "epoch": epoch}}


async def _events(client: httpx.AsyncClient, rid: str, epoch: int) -> list[dict]:
    r = await client.post(INTERNAL_PREFIX + "/prefill", json=_prefill(rid, epoch), headers=control_headers(SECRET))
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    if events and events[-1].get("event") == "kv_held":   # the router's ACK: the rows go back
        await client.post(INTERNAL_PREFIX + "/release", json={"request_id": rid}, headers=control_headers(SECRET))
    return [e for e in events if e["event"] != "wait"]


def _cached(events: list[dict]) -> int:
    return max((e.get("cached_tokens") or 0 for e in events), default=0)


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_request_behind_a_failed_retirement_is_refused_and_the_next_retires_again(loaded_fp32):
    fail: dict = {}
    admitted: list[str] = []
    app, loop = _node(loaded_fp32, fail, admitted)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            old = await _events(client, "old-party", 0)          # the name's first party caches its prompt
            assert old[-1].get("event") == "kv_held", old
            again = await _events(client, "old-party-2", 0)
            assert _cached(again) > 0, again                    # (what a leak looks like: cached tokens)

            # the engine busy, so that the forget message's retirement stays queued while the new
            # party's request, stamped with the same epoch, is admitted behind it
            gate = threading.Event()
            loop.call_soon(lambda e: gate.wait(30))
            await _until(lambda: loop._commands.qsize() == 0, "the engine to take the blocking call")
            fail["retire"] = True
            forget = asyncio.create_task(client.post(
                INTERNAL_PREFIX + "/forget_tenants", json={"tenants": ["bob"], "router": "r1", "epoch": 1},
                headers=control_headers(SECRET)))
            await _until(lambda: loop._commands.qsize() == 1, "the retirement to be queued")
            new = asyncio.create_task(_events(client, "new-party", 1))
            await _until(lambda: loop._commands.qsize() == 2, "the new party's submission to be queued")
            gate.set()
            reply, events = await forget, await new
            assert reply.status_code == 500                      # the retirement raised
            assert events[0]["event"] == "rejected" and events[0]["code"] == "engine_unavailable", events
            assert "could not be retired" in events[0]["message"]
            # refused before the engine admitted it: it attached no page of the old party's prompt
            # and ran no step over one (found in review: refused after its submission came back,
            # it had attached 48 cached tokens, prefilled and held transfer rows)
            assert "new-party" not in admitted, admitted

            fail["retire"] = False                               # the next request of the pair retires first
            after = await _events(client, "new-party-2", 1)
            assert after[-1].get("event") == "kv_held", after
            assert _cached(after) == 0, after                    # nothing of the old party's prompt

    try:
        asyncio.run(run())
    finally:
        loop.stop()
