"""Test harness: real uvicorn servers on free loopback ports, on the session's shared weights in the
default configuration (bfloat16, fused kernels where built).

Each server has its own engine thread and KV pool (32 MiB, context clamped to fit), and a
spy that records which tenant every request reached the engine as, and can corrupt a
request's block table before a step (to show a real isolation check firing through HTTP).
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.server.app import ServerState, create_app
from kvfence.server.http_limits import HttpLimits, uvicorn_server

TENANTS_TOML = """
[defaults]
max_concurrent_requests = 16

[tenants.alice]
api_keys = ["sk-alice-0001", "sk-alice-0002"]

[tenants.bob]
api_keys = ["sk-bob-00000001"]

[tenants.capped]
api_keys = ["sk-capped-0001"]
max_prompt_tokens = 16

[tenants.solo]
api_keys = ["sk-solo-000001"]
max_concurrent_requests = 1

[tenants.metered]
api_keys = ["sk-metered-001"]
tokens_per_minute = 60

[tenants.pub1]
api_keys = ["sk-pub1-000001"]
public_prefix_scope = "shared-docs"

[tenants.pub2]
api_keys = ["sk-pub2-000001"]
public_prefix_scope = "shared-docs"

[metrics]
api_keys = ["sk-scraper-0001"]
"""
SCRAPER_KEY = "sk-scraper-0001"   # /metrics names every tenant: only this key (or an operator's) reads it
KEYS = {"alice": "sk-alice-0001", "alice2": "sk-alice-0002", "bob": "sk-bob-00000001", "capped": "sk-capped-0001",
        "solo": "sk-solo-000001", "metered": "sk-metered-001", "pub1": "sk-pub1-000001", "pub2": "sk-pub2-000001"}
MODEL = "SmolLM2-135M-Instruct"
# The default dtype, as `kvfence serve` runs: a decode step takes ~11 ms here against float32's
# ~60 ms (the server tests took 451 s in float32, 283 s in bf16). 32 MiB of bf16 pages holds the
# 1,440-token context that 64 MiB of float32 held. Answers are compared with float32 elsewhere
# (tests/integration: parity, fidelity; test_coherence_default through this server).
ENGINE = dict(dtype="bfloat16", kv_cache_memory="32MiB", clamp_context=True, progress=False)


class SpyEngine:
    """Builds an LLMEngine whose add_request records (tenant, prompt) per request id, and whose
    step first applies any armed fault."""

    def __init__(self, config: EngineConfig, loaded, gate: threading.Event | None = None):
        self.config, self.loaded, self.gate = config, loaded, gate
        self.seen: dict[str, tuple[str, object]] = {}
        self.ran: set[str] = set()   # request ids that had K/V computed in a step
        self.fault_tenants: set[str] = set()
        # a request of these tenants gets another running request's first page in its block
        # table (that page's own epoch): a read of someone else's KV, which the ledger must refuse
        self.foreign_tenants: set[str] = set()
        self.crash = False
        self.step_delay = 0.0   # seconds each step waits first: a test can act while a prefill runs

    def __call__(self) -> LLMEngine:
        if self.gate is not None:
            self.gate.wait(60)
        eng = LLMEngine(self.config, self.loaded)
        add, step = eng.add_request, eng.step

        def add_request(prompt_ids, params, tenant="default", request_id=None, prompt=None, **kw):
            self.seen[request_id] = (tenant, prompt)
            return add(prompt_ids, params, tenant=tenant, request_id=request_id, prompt=prompt, **kw)

        def faulty_step():
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.crash:
                raise RuntimeError("injected engine crash")
            for seq in list(eng.requests.values()):
                if seq.tenant in self.fault_tenants and seq.num_computed > 0 and seq.table.pages:
                    self.fault_tenants.discard(seq.tenant)
                    seq.table.epochs[0] -= 1      # a stale reference to its own first page
                if seq.tenant in self.foreign_tenants and seq.num_computed > 0 and seq.table.pages:
                    other = next((o for o in eng.requests.values() if o.tenant != seq.tenant and o.table.pages
                                  and o.num_computed > 0), None)
                    if other is not None:
                        self.foreign_tenants.discard(seq.tenant)
                        seq.table.pages[0], seq.table.epochs[0] = other.table.pages[0], other.table.epochs[0]
            out = step()
            self.ran.update(rid for rid, seq in eng.requests.items() if seq.num_computed > 0)
            return out

        eng.add_request, eng.step = add_request, faulty_step
        return eng


class LiveServer:
    def __init__(self, state: ServerState, spy: SpyEngine, limits: HttpLimits | None = None):
        self.state, self.spy, self.engine = state, spy, state.engine
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.server = uvicorn_server(create_app(state), "127.0.0.1", self.port, limits or HttpLimits(),
                                     access_log=True, log_config=None, timeout_graceful_shutdown=2,
                                     refusals=state.metrics.connections)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)

    def client(self, who: str | None = "alice", **kw) -> openai.OpenAI:
        key = KEYS.get(who, who) if who else "none"
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def async_client(self, who: str | None = "alice") -> openai.AsyncOpenAI:
        key = KEYS.get(who, who) if who else "none"
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)

    def http(self, who: str | None = "alice", **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEYS.get(who, who)}"} if who else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def metrics(self) -> dict:
        """{(name, frozenset(labels.items())): value} of every sample at /metrics."""
        r = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}, timeout=30)
        r.raise_for_status()
        text = r.text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until the engine has no request and no page is owned; return the snapshot."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine.snapshot
            if s.get("running") == 0 and s.get("waiting") == 0 and s.get("pages_owned") == 0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop()


def pool_intact(s: dict) -> bool:
    """No page owned by a request, none quarantined, and every page either free or held by
    the prefix cache (reclaimable): nothing leaked."""
    return (s.get("pages_owned") == 0 and s.get("pages_quarantined") == 0
            and s.get("pages_free", 0) + s.get("pages_shared", 0) == s.get("pages_total"))


def wait_for(pred, timeout: float = 20.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)
