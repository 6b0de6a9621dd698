"""A deterministic simulation of a PD cluster: one seeded RNG drives a sim router, a prefill
node and a decode node (the real LLMEngine, KvExporter and KvImporter), a simulated transfer
engine (kvfence/sim/transport.py) and a virtual clock, and checks the isolation invariants
(docs/DESIGN: I1-I6 and I9; I8 with a fleet; I10 and I11 against the adversary) after every step.

Each step is one action chosen by the RNG: a client request arrives, a node runs one engine
step, the router hands a manifest to decode, a pull runs, a completion notice or a router
message (ACK, abort, a dropped stream) is delivered, a client disconnects, time passes
(small steps, or jumps past leases, give-ups and fences), or a node crashes and restarts
(a new engine and link, a new boot id; its transfer-buffer memory may come back
registered under the same address with the old bytes in it, like un-zeroed memory).

The sim router follows kvfence/pd/router.py's RouterBackend._run step by step:
admission -> prefill(hold_kv) -> manifest -> decode(kv_source) -> ACK (exporter.release)
on kv_verified; on any failure or disconnect it relays an abort to prefill with
reader_stopped as decode reported it; a node that stops answering fails the requests whose
streams it held (node_failed), and the node process aborts a request whose router stream
went away (only while that stream is open, as kvfence/pd/node.py does). A node that failed
a handoff before anything reached the client has the whole request done again without it,
as a new life `<rid>.redo` (may_redo), where the fleet has another node of its role.

With SimConfig.routers, router processes and parties too (kvfence/sim/scopes.py).

Everything is synchronous and seeded: a failing seed reproduces exactly, and the failure
prints the seed and the last steps of the trace.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import random
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfence import faults
from kvfence.engine.admission import ContextLengthExceeded, Overloaded
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.params import SamplingParams
from kvfence.engine.request_states import TERMINAL, State
from kvfence.kv.ledger import PageState
from kvfence.kv.pool import page_bytes
from kvfence.pd.capacity import plan_fleet
from kvfence.pd.decode import KvImporter
from kvfence.pd.drain import idle as drained_idle
from kvfence.pd.fleet import Fleet
from kvfence.pd.manifest import ManifestError
from kvfence.pd.messages import NodeInfo
from kvfence.pd.node import unchecked_boot
from kvfence.pd.prefill import KvExporter
from kvfence.pd.router import (
    culprit_of_decode_failure,
    may_redo,
    may_retry_decode,
    may_retry_prefill,
    nodes_to_avoid,
    ready_elsewhere,
)
from kvfence.pd.scope_epochs import ScopeGate
from kvfence.pd.settings import PDSettings
from kvfence.pd.transfer import InProcessTransport
from kvfence.server.engine_loop import engine_facts
from kvfence.sim.adversary import NetworkAdversary
from kvfence.sim.scopes import Forget, ScopeModel, SimRouter
from kvfence.sim.transport import FAILING_FATES, SimPull, SimTransport, SimWorkers

_uids = itertools.count(1)
SIM_SECRET = b"the simulated cluster's secret (32+ bytes)"
POLL_S = 1.0   # the router's monitor asks every node for /internal/info this often (RouterBackend.poll_s)

# PageState values as plain ints: an enum attribute lookup costs microseconds, and the
# checks below do thousands per step
FREE, OWNED, QUARANTINED, RESERVED_NULL, SHARED = (int(PageState.FREE), int(PageState.OWNED),
                                                    int(PageState.QUARANTINED), int(PageState.RESERVED_NULL),
                                                    int(PageState.SHARED))

# error codes a client may get, and which injected events explain each (any one will do)
EXPLAINED_BY = {
    "client": {"client_abort"},
    "kv_transfer_failed": {"transfer", "crash"},
    "kv_verification_failed": {"transfer", "crash", "adversary"},
    "kv_transfer_timeout": {"slow"},
    "lease_expired": {"slow"},
    "node_failed": {"crash"},
    "node_unavailable": {"crash", "fleet"},
    "not_ready": {"crash", "fleet"},
    "draining": {"fleet"},
    "scope_retired": {"rekey"},   # its key was revoked by a reload a node had already carried out
    "engine_unavailable": {"retire_fail"},   # queued behind a retirement of its scope that failed
    "server_overloaded": {"load"},   # a node's queue was full (SimConfig.max_waiting), on every node tried
    "kv_pool_exhausted": {"known_bug_pool_held_outside_scheduler"},
}

# Bugs this simulation found in code it may not change, which a configuration can excuse so
# that a run goes on to look for others (each is counted in the result's stats):
KNOWN_BUGS = {
    "pool_held_outside_scheduler":
        "(fixed in 720c56b) a node aborts a request that fits with kv_pool_exhausted while pool pages are held by "
        "PD requests outside its scheduler (prefill: prompts waiting for transfer-buffer rows in "
        "KvExporter.pending; decode: reservations AWAITING_KV), because Scheduler.schedule() took 'nothing "
        "running' to mean 'no page will ever come back'",
    "idle_with_work":
        "(fixed in c07c3eb) a node goes idle (engine.has_unfinished() False: the server loop blocks until a command "
        "or its next "
        "timer) while a queued PD request could be served now: KvExporter.busy() is False while computed "
        "prompts wait for transfer-buffer rows, and KvExporter.before_step() stages them before it expires leases and "
        "lifts fences, so rows freed there strand them (forever when no timer is left); KvImporter.busy() is "
        "False while requests wait for pages and rows, which come back when a request ends after poll() ran, "
        "so they wait for their lease deadline and fail with lease_expired. Excused, the node is woken as if "
        "some other event had come",
}


@dataclass
class SimConfig:
    seed: int = 0
    lives: int = 1000               # client requests that arrive
    layers: int = 1
    hidden: int = 32
    page_size: int = 4
    context: int = 64               # usable context (max_model_len) of prefill, and decode unless set
    decode_context: int | None = None
    prefill_pages: int = 40         # usable KV pool pages
    decode_pages: int = 40
    prefill_rows: int = 24          # transfer-buffer rows
    decode_rows: int = 24
    max_batched_tokens: int = 48    # engine token budget per step (chunked prefill)
    max_num_seqs: int = 16
    concurrency: int = 8            # requests in flight at the router
    tenants: int = 4
    max_gen: int = 12               # max_tokens is drawn from 1 .. max_gen
    over_length: float = 0.08       # share of prompts drawn around and beyond the context
    one_token: float = 0.03         # share of one-token prompts (the router sends them straight to decode)
    prefix_share: float = 0.5       # share of prompts that start with a shared prefix (prefix-cache hits)
    router_check: float = 0.7       # share of requests the router admits itself; the rest reach the nodes'
                                    # own admission unchecked (as with the skip_router_admission fault)
    lease_s: float = 30.0
    max_pull_s: float = 75.0
    pull_give_up_s: float = 10.0
    clock_skew_s: float = 1.0       # what the nodes are told
    true_skew: float | None = None  # the real bound on the clocks' difference (default: clock_skew_s)
    w_abort: float = 0.15           # action weights
    w_crash: float = 0.004
    w_jump: float = 0.12
    w_adversary: float = 0.0        # the network adversary's actions (kvfence/sim/adversary.py)
    slow_pulls: float = 0.1         # share of pulls that take a random time up to max_pull_s to run
    reuse_memory: float = 0.5       # a restarted node gets its old transfer-buffer memory back, un-zeroed
    pull_fates: dict = field(default_factory=lambda: {"ok": 0.86, "fail": 0.03, "partial": 0.02, "corrupt": 0.04,
                                                      "short_ok": 0.02, "cut": 0.03})
    notice_fates: dict = field(default_factory=lambda: {"deliver": 0.9, "drop": 0.04, "duplicate": 0.06})
    full_check_every: int = 25      # Ledger.check_consistency() itself (a Python loop over pages) every this
                                    # many steps and at the end; fast_consistency(), the same checks
                                    # vectorized, after every other step
    check_admission: bool = True    # the simulation's own I4 checks (what each node admitted, 400s)
    check_handoff: bool = True      # its own I5 checks (token counts, the content oracle); with both off,
                                    # only the ledgers, the read audits and I6 watch (defense in depth)
    known_bugs: tuple = ()          # names in KNOWN_BUGS whose symptom is excused (and counted)
    drain_steps: int = 20_000       # a drain longer than this is a livelock
    trace_len: int = 300
    trace_all: bool = False         # print every step as it happens
    # the fleet (kvfence/pd/fleet.py routes across it): nodes per role, drains (a node takes
    # nothing new, finishes, exits, restarts), and restarts that come up misconfigured (a pool
    # below the advertised context: the router must refuse the node, I8)
    prefill_nodes: int = 1
    decode_nodes: int = 1
    w_drain: float = 0.0
    misconfigured: float = 0.0      # share of restarts that come up with a pool below the advertised context
    # cache scopes across router processes (pd/scope_epochs.py, engine/router_realms.py): with
    # `routers`, requests are stamped by router processes; a tenant's name is given to another
    # party (its keys replaced), each router reloads the file in its own time and sends a forget
    # message that nodes may miss, routers restart under new ids, and nodes retire the scopes of
    # a router silent for router_idle_s. The check: no cache scope ever holds two parties (I9).
    routers: int = 0                # 0: requests carry no stamp, as from a router before stamps
    w_rekey: float = 0.0            # the tenants file gives a name to another party
    w_router_restart: float = 0.0
    forget_drop: float = 0.0        # share of forget messages a node never gets
    retire_fail: float = 0.0        # share of a node's queued scope retirements that raise
    router_idle_s: float = 600.0
    # client requests for n choices (kvfence/server/app.py submits them at once; the router
    # starts each choice after its first one's prompt is held on prefill, `after`, and names
    # the first in the handoff, `choice_of`, by which decode reserves a request's choices
    # together): the share of requests with 2..max_choices, and the server's rule that one
    # choice refused before admission ends the request (the others are aborted)
    choices: float = 0.0
    max_choices: int = 4
    # the engines' scheduling settings (EngineConfig): the prefill cap while decoding (0: none)
    # and each tenant's share of the running slots; the cap is fixed (no step-time target, which
    # learns from wall-clock step times: a run would not replay)
    prefill_cap: int = 256
    running_share: float = 0.75
    step_target: bool = True
    max_waiting: int = 1024         # each node's queue (EngineConfig.max_waiting): beyond it, server_overloaded

    @classmethod
    def draw(cls, seed: int, lives: int = 1000, fleet: bool = False, scopes: bool = False, choices: bool = False,
             sched: bool = False, **overrides) -> SimConfig:
        """A configuration drawn from the seed, so that a campaign covers many regimes: pool
        and buffer sizes, concurrency, chunking, crash, abort and transfer-fault rates; with
        `fleet`, 2-4 prefill and 2-4 decode nodes, drains and misconfigured restarts too; with
        `scopes`, 1-3 router processes, names given to new parties, lost forget messages,
        router restarts and idle routers' scopes retired; with `choices`, requests for n > 1
        choices (a share of 0.2-0.8 of them, 2-8 choices); with `sched`, the engines' prefill
        cap while decoding (none, 4, 16, 64 or 256 tokens), tenants' running share, the
        nodes' queue size (1024, 16, 4, 2: refusals for load, retried on another node) and the
        page size (4, 8, 16)."""
        r = random.Random(f"config-{seed}")
        ps = 4
        ctx = r.choice([32, 48, 64, 96])
        pages = ctx // ps
        scale = r.choice([0.0, 0.5, 1.0, 2.0])
        fates = {"ok": 1.0 - 0.14 * scale, "fail": 0.03 * scale, "partial": 0.02 * scale, "corrupt": 0.04 * scale,
                 "short_ok": 0.02 * scale, "cut": 0.03 * scale}
        # the protocol's timers: the defaults, and shorter ones, under which fences turn over
        # faster than requests arrive (so fenced rows do not simply fill the transfer buffer)
        lease, max_pull, give_up, skew = r.choice([(30.0, 75.0, 10.0, 1.0), (5.0, 8.0, 2.0, 0.5), (2.0, 3.0, 1.0, 0.2)])
        drop = r.choice([0.0, 0.03, 0.08])
        dup = r.choice([0.0, 0.05, 0.15])
        kw = dict(seed=seed, lives=lives, context=ctx, page_size=ps,
                  prefill_pages=int(pages * r.uniform(1.0, 2.5)) + 1, decode_pages=int(pages * r.uniform(1.0, 2.5)) + 1,
                  lease_s=lease, max_pull_s=max_pull, pull_give_up_s=give_up, clock_skew_s=skew,
                  prefill_rows=pages + r.randint(0, 12), decode_rows=pages + r.randint(0, 12),
                  max_batched_tokens=r.choice([8, 16, 32, 64, 128]), max_num_seqs=r.choice([2, 4, 8, 16]),
                  concurrency=r.randint(2, 12), tenants=r.randint(1, 5), max_gen=r.choice([4, 8, 16]),
                  router_check=r.choice([0.5, 0.8, 1.0]), slow_pulls=r.choice([0.0, 0.05, 0.2]),
                  w_abort=r.choice([0.02, 0.15, 0.5]),
                  w_crash=r.choice([0.0, 0.002, 0.006]), w_jump=r.choice([0.05, 0.12, 0.3]),
                  pull_fates=fates, notice_fates={"deliver": 1.0 - drop - dup, "drop": drop, "duplicate": dup})
        if r.random() < 0.5:   # the default: as many rows as pool pages
            kw.update(prefill_rows=kw["prefill_pages"], decode_rows=kw["decode_pages"])
        # a network adversary in most campaigns (drawn last: the other draws stay as they were)
        kw["w_adversary"] = r.choice([0.0, 0.02, 0.1, 0.3])
        if fleet:   # drawn after everything else, from its own stream: the rest is as without it
            f = random.Random(f"fleet-{seed}")
            kw.update(prefill_nodes=f.randint(2, 4), decode_nodes=f.randint(2, 4),
                      w_crash=f.choice([0.002, 0.006, 0.012]), w_drain=f.choice([0.002, 0.006, 0.02]),
                      misconfigured=f.choice([0.0, 0.2, 0.5]), concurrency=f.randint(4, 16))
        if scopes:   # its own stream too
            g = random.Random(f"scopes-{seed}")
            kw.update(routers=g.randint(1, 3), w_rekey=g.choice([0.01, 0.03, 0.1]),
                      w_router_restart=g.choice([0.0, 0.005, 0.02]), forget_drop=g.choice([0.0, 0.3, 0.7]),
                      router_idle_s=g.choice([30.0, 120.0, 600.0]), tenants=g.randint(1, 3))
            kw.update(retire_fail=g.choice([0.0, 0.1, 0.3]))   # drawn last: the draws above stay
        if choices:   # its own stream too
            h = random.Random(f"choices-{seed}")
            kw.update(choices=h.choice([0.2, 0.5, 0.8]), max_choices=h.choice([2, 3, 4, 8]))
        if sched:   # and its own
            k = random.Random(f"sched-{seed}")
            kw.update(prefill_cap=k.choice([0, ps, 16, 64, 256]), running_share=k.choice([1.0, 0.75, 0.5, 0.25]),
                      step_target=False)
            kw.update(max_waiting=k.choice([1024, 16, 4, 2]))   # drawn last: the draws above stay
            # the page size too (4 above; the real default is 16): the pools and buffers keep
            # the same number of tokens, in fewer, larger pages (contexts are multiples of 16)
            big = k.choice([4, 8, 16])
            if big != ps:
                kw.update(page_size=big, **{f: -(-kw[f] * ps // big) + 1 for f in
                                            ("prefill_pages", "decode_pages", "prefill_rows", "decode_rows")})
        kw.update(overrides)
        return cls(**kw)


class SimFailure(AssertionError):
    """An invariant violation (or a request outcome the injected events do not explain)."""

    def __init__(self, seed: int, step: int, invariant: str, message: str, trace: list[str]):
        self.seed, self.step, self.invariant, self.message, self.trace = seed, step, invariant, message, trace
        super().__init__(f"seed {seed}, step {step}: {invariant}: {message}")

    def report(self) -> str:
        return "\n".join([f"SIMULATION FAILED: seed {self.seed}, step {self.step}", f"  {self.invariant}: "
                          f"{self.message}", f"  reproduce: python -m kvfence.sim --seed {self.seed} --trace",
                          f"  last {len(self.trace)} steps:"] + [f"    {t}" for t in self.trace])


@dataclass
class Life:
    """One client request, as the router and the checker see it."""
    n: int
    rid: str
    tenant: str
    ids: list[int]
    params: SamplingParams
    over_p: bool                  # prompt + max_tokens exceeds prefill's usable context
    over_d: bool                  # ... decode's
    stage: str = "new"            # new -> prefill -> handoff -> decode -> done
    router_live: bool = True      # the router's task for it is running (not answered, not cancelled)
    manifest: dict | None = None  # what the router got from prefill
    held: dict | None = None      # the manifest prefill produced (even if the router was gone by then)
    truth: torch.Tensor | None = None  # the staged rows' data bytes at kv_held: what decode must end up with
    p_node: str = ""              # the prefill node it was routed to (its name; "" before routing)
    p_boot: int = -1
    p_owner: int = -1             # the prefill Sequence's owner number (its pages' and rows' owner)
    d_node: str = ""
    d_boot: int = -1
    redone: bool = False          # this is a request done again after its first attempt's handoff failed
    p_tries: int = 0              # nodes tried (RouterBackend._prefill_on_some_node / _decode_on_some_node)
    d_tries: int = 0
    p_excluded: set = field(default_factory=set)
    d_excluded: set = field(default_factory=set)
    p_flight: object = None       # the fleet Node counting it in flight (kvfence/pd/router._routed)
    d_flight: object = None
    d_owner: int = -1
    p_sink: bool = False          # the prefill node's stream for it is open
    d_sink: bool = False
    released: bool = False
    abort_posted: bool = False
    reader_stopped: bool = False  # decode is known not to be pulling (refused, or said so)
    decode_contacted: bool = False
    verified: bool = False
    pull_started: float | None = None  # decode's clock when its pull was submitted
    tokens: list[int] = field(default_factory=list)
    excuses: set[str] = field(default_factory=set)
    must_fail: set[str] = field(default_factory=set)  # injected events after which a 200 would be wrong
    result: str | None = None     # "200", "error" or "gone" (client disconnected)
    code: str | None = None
    finish_reason: str | None = None
    router: str = ""              # the router process that checked its key ("": unstamped)
    epoch: int = 0                # its stamp: that router's scope epoch of the tenant then
    party: tuple = ()             # who sent it: (tenant name, the party holding the name's keys)
    request: str = ""             # the client request it is a choice of: its first choice's rid ("": its own)
    after: str = ""               # a later choice: the first choice whose prompt it waits for (the router's `after`)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def origin(self) -> str:
        """Its rid before a redo: the router's request id, under which its task runs."""
        return self.rid.removesuffix(".redo")

    @property
    def client(self) -> str:
        """The router's choice_of: the client request's first choice's id."""
        return self.request or self.origin


@dataclass
class Msg:
    kind: str          # release | abort (router -> prefill /internal/*), stop_pull (router -> decode, then its
                       # answer goes on to prefill as an abort), drop (the router's stream closed)
    node: str          # the node's name
    rid: str
    boot: int          # the node process the message was sent to
    reader_stopped: bool = False


class Node:
    def __init__(self, sim: Simulation, role: str, name: str):
        self.sim, self.role, self.name = sim, role, name
        self.fnode = None      # the router's record of it (kvfence/pd/fleet.Node)
        self.draining = False  # told to drain: takes nothing new, exits once idle (kvfence/pd/drain.py)
        self.small = False     # this boot came up with a pool below the advertised context (I8: refused)
        self.boot = 0
        self.engine: LLMEngine | None = None
        self.link = None
        self.transport: InProcessTransport | None = None
        self.down_until: float | None = None
        self.offset = 0.0
        self.stalled = False   # its last step changed nothing: stepping again is pointless until something else happens
        self.reused_memory = False   # restarted on its old, un-zeroed transfer-buffer memory
        self.poked = False     # a message or notice reached it: the server's loop runs a step after each one
        self.new_scope_gate()

    def new_scope_gate(self) -> None:
        """Its process's scope table (kvfence/pd/node.py), and the retirements it queued that
        the engine has not run yet: a new process starts with neither."""
        self.retirements: list[tuple[Future, list[str], str]] = []
        self.scopes = ScopeGate(self._queue_retirement)

    def _queue_retirement(self, tenants: list[str], router: str) -> Future:
        """EngineLoop.retire_soon: a command the engine runs before anything queued after it."""
        outcome: Future = Future()
        self.retirements.append((outcome, tenants, router))
        return outcome

    @property
    def up(self) -> bool:
        return self.engine is not None

    def clock(self) -> float:
        return self.sim.now + self.offset


def fast_consistency(led) -> None:
    """Ledger.check_consistency()'s checks, vectorized (the method loops over pages in Python,
    about a millisecond per call on these pools; the simulation checks four ledgers a step).
    On any disagreement it calls the method itself, which raises with the details."""
    st = led.state
    n = led.num_pages
    on_free = np.bincount(np.fromiter(led._free, dtype=np.int64, count=len(led._free)), minlength=n)
    evict = np.zeros(n, dtype=bool)
    if led._evictable:
        evict[list(led._evictable)] = True
    owner = led.owner_request
    bad = (on_free > 1) | ((on_free == 1) != (st == FREE)) | ((st == SHARED) != (evict | (led.refcount > 0)))
    bad |= ((st != OWNED) & (owner != -1)) | ((st == OWNED) & (owner < 0))
    if on_free[0]:
        from kvfence.kv.ledger import LedgerError
        raise LedgerError("the null page is on the free list")
    if st[0] != RESERVED_NULL or bad[1:].any():
        led.check_consistency()
        raise AssertionError("fast_consistency and Ledger.check_consistency disagree")


_LOADED: dict = {}


def shared_model(layers: int, hidden: int):
    from kvfence.sim.model import tiny_loaded

    key = (layers, hidden)
    if key not in _LOADED:
        _LOADED[key] = tiny_loaded(layers=layers, hidden=hidden)
    return _LOADED[key]


@contextlib.contextmanager
def quiet_logs(level: int = logging.CRITICAL + 1):
    lg = logging.getLogger("kvfence")
    old = lg.level
    lg.setLevel(level)
    try:
        yield
    finally:
        lg.setLevel(old)


class Simulation(ScopeModel):
    def __init__(self, cfg: SimConfig, loaded=None):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.uid = next(_uids)
        self.loaded = loaded or shared_model(cfg.layers, cfg.hidden)
        self.settings = PDSettings("prefill", lease_s=cfg.lease_s, max_pull_s=cfg.max_pull_s,
                                   pull_give_up_s=cfg.pull_give_up_s, clock_skew_s=cfg.clock_skew_s,
                                   transfer_timeout_s=min(5, int(cfg.max_pull_s)), cluster_secret=SIM_SECRET)
        self.true_skew = cfg.clock_skew_s if cfg.true_skew is None else cfg.true_skew
        self.now = 1000.0
        self.step_no = 0
        self.arrived = 0
        self.draining = False
        self.lives: dict[str, Life] = {}
        self.open: list[Life] = []         # router_live lives
        self.groups: dict[str, list[str]] = {}   # a client request of n > 1 choices -> its choices' rids
        self.prompt_held: set[str] = set()       # requests whose later choices may go (RouterBackend._prompt_held)
        self.dropping: list[str] = []            # choices the server is aborting (another was refused)
        self.msgs: list[Msg] = []
        self.delivered: deque[Msg] = deque(maxlen=64)   # what the adversary may replay
        self.adversary = NetworkAdversary(self)
        # plaintexts prefill sealed in the current step, in order (_watch_stage); each kv_held
        # output of that step takes the next one
        self._staged_plain: deque[torch.Tensor] = deque()
        self.trace: deque[str] = deque(maxlen=cfg.trace_len)
        self.digest = hashlib.blake2b(digest_size=16)  # of every trace line: equal runs, equal digests
        self.outcomes: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self.transport = SimTransport(self)
        # (importer boot id, pull id) -> the pull's row owner, row epochs, start (decode clock)
        self._pull_meta: dict[tuple[str, int], tuple[int, list[int], float]] = {}
        self._unstaged: dict[int, torch.Tensor] = {}
        self._unservable: dict[str, bool] = {}
        self._moved = False
        self._names: dict[int, str] = {}   # owner number -> "request@node"
        self._fates = (list(cfg.pull_fates), list(cfg.pull_fates.values()))
        self._nfates = (list(cfg.notice_fates), list(cfg.notice_fates.values()))
        vocab = self.loaded.model.config.vocab_size
        # shared prefixes: the same tokens for every tenant, so a cross-tenant prefix-cache hit
        # would be possible if the cache were not tenant-scoped (I9)
        self.prefixes = [[self.rng.randrange(2, vocab) for _ in range(self.rng.randint(3, 6) * cfg.page_size)]
                         for _ in range(3)]
        # router processes and parties, on their own RNG: runs without them replay as before
        self.srng = random.Random(f"scopes-{cfg.seed}")
        self.party = {f"tenant{i}": 0 for i in range(cfg.tenants)}   # the tenants file: name -> its party now
        self.routers = [SimRouter(f"router-{j}", dict(self.party)) for j in range(cfg.routers)]
        self.forgets: list[Forget] = []
        # (node, boot, cache scope id) -> the party whose requests used it: one each, ever (I9)
        self.scope_party: dict[tuple[str, int, int], tuple] = {}
        names = {role: [role] + [f"{role}-{i}" for i in range(2, count + 1)]
                 for role, count in (("prefill", cfg.prefill_nodes), ("decode", cfg.decode_nodes))}
        self.nodes = {name: Node(self, role, name) for role, ns in names.items() for name in ns}
        for node in self.nodes.values():
            self._start(node, None)
        # the router's start-up check and fleet: the real code (kvfence/pd/capacity.py, fleet.py)
        chk = plan_fleet(None, {n.name: (n.role, self._info(n)) for n in self.nodes.values()}, clamp=False)
        if not chk.ok or chk.reference is None:
            raise ValueError(f"the simulated fleet fails its start-up check: {chk.note}")
        self.advertised = chk.usable_context
        # the most choices the server lets through (app.py's too_many_choices: a tenant's waiting places)
        self.max_choices = min(n.engine.config.tenant_waiting_places for n in self.nodes.values())
        self.fleet = Fleet(names, chk.usable_context, chk.reference)
        for node in self.nodes.values():
            node.fnode = self.fleet.by_url(node.name)
        self._poll()
        self.started_at = time.perf_counter()

    # -- nodes ------------------------------------------------------------------------------
    def _engine_config(self, role: str, small: bool = False) -> EngineConfig:
        c = self.cfg
        pb = page_bytes(self.loaded.model.config, c.page_size, torch.float32)
        pages = c.prefill_pages if role == "prefill" else c.decode_pages
        ctx = c.context if role == "prefill" else (c.decode_context or c.context)
        if small:   # the incident's configuration: less KV memory than the fleet advertises
            # half, in whole pages: below the advertised context whatever the page size (max(4
            # pages, half) was 64 tokens with pages of 16, a node larger than the fleet's)
            ctx = max(c.page_size, ctx // 2 // c.page_size * c.page_size)
            pages = ctx // c.page_size + 1
        return EngineConfig(dtype="float32", device="cpu", page_size=c.page_size, kv_cache_memory=(pages + 1) * pb,
                            max_model_len=ctx, scrub="none", audit_reads=True, num_threads=1, progress=False,
                            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_batched_tokens,
                            prefill_tokens_while_decoding=c.prefill_cap, tenant_running_share=c.running_share,
                            max_waiting=c.max_waiting,
                            **({} if c.step_target else {"decode_step_target_ms": 0.0}),
                            enable_prefix_cache=(role == "prefill"))

    def _start(self, node: Node, old: tuple | None) -> None:
        """Boot a node: a fresh engine and link. `old` = (transport, buffer) of the process
        before a crash whose memory the new one gets back, registered at the same address."""
        c = self.cfg
        node.boot += 1
        node.draining = False
        eng = LLMEngine(self._engine_config(node.role, node.small), self.loaded)
        node.offset = self.rng.uniform(-self.true_skew / 2, self.true_skew / 2)
        eng.clock = node.clock
        eng.steady_clock = node.clock   # router idleness on the virtual clock too
        eng.realms.idle_s = c.router_idle_s
        node.new_scope_gate()   # a new process: its table starts empty
        name = old[0].session_id if old else f"sim{self.uid}:{node.name}:{node.boot}"
        tr = InProcessTransport(name)
        st = PDSettings(node.role, transfer_buffer_pages=c.prefill_rows if node.role == "prefill" else c.decode_rows,
                        lease_s=c.lease_s, max_pull_s=c.max_pull_s, pull_give_up_s=c.pull_give_up_s,
                        clock_skew_s=c.clock_skew_s, transfer_timeout_s=self.settings.transfer_timeout_s,
                        cluster_secret=SIM_SECRET)
        if node.role == "prefill":
            link = KvExporter(eng, st, tr)
        else:
            link = KvImporter(eng, st, tr, workers=1)
            link._workers.shutdown(wait=False)
            link._workers = SimWorkers(self.transport, link)
        if old is not None:  # the same memory, same address, old bytes: nothing zeroed it
            link.staging.buf = old[1]
            link.base = tr.register(old[1])
        if node.role == "decode":
            self._watch_unstage(link)
        else:
            self._watch_stage(link)
        self._watch_unservable(node, eng)
        node.engine, node.link, node.transport = eng, link, tr
        node.down_until = None
        node.reused_memory = node.reused_memory or old is not None

    def _info(self, node: Node) -> NodeInfo:
        """The node's /internal/info answer (kvfence/pd/node.py)."""
        snap = node.engine.stats()
        snap["draining"] = node.draining
        return NodeInfo.from_json({**engine_facts(node.engine), "snapshot": snap})

    def _poll(self) -> None:
        """The router's monitor (RouterBackend.run_monitor): every node's facts, checked (I8)."""
        for node in self.nodes.values():
            before = node.fnode.state
            if node.up:
                self.fleet.observe(node.fnode, self._info(node))
            else:
                self.fleet.observe(node.fnode, None, "does not answer (ConnectError)")
            if node.fnode.state != before:
                self.stats[f"fleet_{node.role}_{node.fnode.state}"] += 1
                self._log(f"monitor: {node.name} {before} -> {node.fnode.state}"
                          f"{' (' + node.fnode.reason + ')' if node.fnode.reason else ''}")
        self.next_poll = self.now + POLL_S

    def _boot_of(self, name: str) -> int:
        node = self.nodes[name]
        return node.boot if node.up else -1

    def _crash(self, node: Node, drained: bool = False) -> None:
        """The node's process ends: killed, or (drained) exiting 0 after a drain, which
        releases its memory and leaves nothing behind that a request needs."""
        old_link, old_tr = node.link, node.transport
        reuse = not drained and self.rng.random() < self.cfg.reuse_memory
        self.stats[f"{'drained' if drained else 'crash'}_{node.role}"] += 1
        if node.role == "decode":
            self.stats["pulls_died_with_decode"] += self.transport.forget_importer(old_link)
        if not reuse:
            old_tr.close()   # its registrations are gone: a stale handle's pull fails
        node.engine = node.link = node.transport = None
        downtime = self.rng.choice([0.0, 0.0, self.rng.uniform(0.1, 3.0)])
        node.down_until = self.now + downtime
        node.reuse = (old_tr, old_link.staging.buf) if reuse else None
        self._log(f"{'EXIT (drained)' if drained else 'CRASH'} {node.name} (boot {node.boot}); memory "
                  f"{'kept, un-zeroed' if reuse else 'released'}; down {downtime:.2f}s")
        # the router: every stream this node held drops
        for life in list(self.open):
            on_p = life.p_node == node.name and life.p_boot == node.boot
            on_d = life.d_node == node.name and life.d_boot == node.boot
            if drained:   # its hold lives until decode's ACK or the lease (then the request fails anyway)
                needed = on_p and (life.stage == "prefill" or (
                    not life.verified and life.held is not None and node.clock() < life.held["lease_deadline"]))
                self._check(not (needed or (on_d and life.stage == "decode")), "drain",
                            f"{node.name} exited after draining while {life.rid} (stage {life.stage}) still needed it")
            if on_p and not life.verified:
                life.excuses.add("crash")
                if life.stage == "prefill":   # died before holding the KV: another node may take it
                    self._prefill_failed(life, "node_failed", "the prefill node closed the stream before holding "
                                                              "the KV")
            if on_d:
                life.excuses.add("crash")
                if life.stage == "decode":   # its stream broke off: the decode node failed it
                    self._fail_handoff(life, "node_failed", "decode")
        for life in self.lives.values():
            if life.p_node == node.name and life.p_boot == node.boot:
                life.p_sink = False
            if life.d_node == node.name and life.d_boot == node.boot:
                life.d_sink = False
        # messages in flight to the dead process are lost; a stop_pull's POST fails, and the router
        # then tells prefill a read may still run (_deliver_msg): dropping it here skipped that
        self.msgs = [m for m in self.msgs if not (m.node == node.name and m.boot == node.boot
                                                  and m.kind != "stop_pull")]
        if downtime == 0.0:
            self._restart(node)

    def _restart(self, node: Node) -> None:
        # a restart may come up misconfigured (only drawn when the configuration asks for it,
        # so that other configurations replay as before)
        node.small = bool(self.cfg.misconfigured) and self.rng.random() < self.cfg.misconfigured
        self._start(node, getattr(node, "reuse", None))
        node.reuse = None
        small = " with a pool below the advertised context" if node.small else ""
        self._log(f"RESTART {node.name} (boot {node.boot}){small}")

    def _drain_node(self, node: Node) -> None:
        """POST /internal/drain (or SIGTERM): no new request; the node exits once idle."""
        node.draining = True
        self.stats[f"drain_{node.role}"] += 1
        self._log(f"DRAIN {node.name} (boot {node.boot})")

    def _exit_if_drained(self, node: Node) -> None:
        """kvfence/pd/drain.py: the node exits once no stream is open on it and its engine and
        link have nothing a request still needs."""
        if not (node.up and node.draining):
            return
        streams = sum(1 for lf in self.lives.values()
                      if (lf.p_sink and lf.p_node == node.name and lf.p_boot == node.boot)
                      or (lf.d_sink and lf.d_node == node.name and lf.d_boot == node.boot))
        if not streams and drained_idle(node.engine.stats()):
            self._crash(node, drained=True)

    def _watch_unservable(self, node: Node, eng: LLMEngine) -> None:
        """Observe, when the scheduler gives up on a request (kv_pool_exhausted), whether pool
        pages were held by PD requests outside the scheduler at that moment (KNOWN_BUGS)."""
        sched = eng.scheduler
        orig = sched.schedule

        def schedule():
            out = orig()
            if sched.unservable:
                link = eng.kv_link
                outside = (any(len(s.table) for s in link.pending) if node.role == "prefill"
                           else any(len(s.table) for s in eng.requests.values() if s.state is State.AWAITING_KV))
                for s in sched.unservable:
                    self._unservable[s.request_id] = outside
            return out

        sched.schedule = schedule

    def _watch_stage(self, exp: KvExporter) -> None:
        """Observe, for the content oracle, the plaintext prefill seals for each hold."""
        st = exp.staging
        orig = st.plaintext_rows

        def plaintext_rows(pages, token_count):
            plain = orig(pages, token_count)
            self._staged_plain.append(plain.clone())
            return plain

        st.plaintext_rows = plaintext_rows

    def _watch_unstage(self, imp: KvImporter) -> None:
        """Observe, for the content oracle, what decode copies into its pool after verifying."""
        st = imp.staging
        orig = st.unstage

        def unstage(plain, pages):
            # the pool pages' owner record names the same request number as its rows'
            owner = int(imp.engine.ledger.owner_request[pages[0]]) if pages else -1
            orig(plain, pages)
            pool = imp.engine.pool
            slots = pool.slots_of(torch.as_tensor(pages, dtype=torch.int64))
            self._unstaged[owner] = pool.kv.index_select(3, slots).clone()

        st.unstage = unstage

    # -- random draws -------------------------------------------------------------------------
    def draw_fate(self) -> str:
        return self.rng.choices(*self._fates)[0]

    def draw_pull_duration(self) -> float:
        if self.rng.random() < self.cfg.slow_pulls:
            return self.rng.uniform(0.0, self.settings.max_pull_s)
        return 0.0

    def draw_notice_fate(self) -> str:
        return self.rng.choices(*self._nfates)[0]

    def on_pull_submitted(self, p: SimPull) -> None:
        rec = p.importer.pulls[p.pull_id]
        self._pull_meta[(p.importer.boot_id, p.pull_id)] = (rec.owner.request, list(rec.rows.epochs), rec.started)
        life = self.lives.get(p.request_id)
        if life is not None:
            life.pull_started = rec.started
            if p.fate in FAILING_FATES:
                life.excuses.add("transfer")
                life.must_fail.add(f"pull fate {p.fate}")
            if p.notice_fate == "drop":
                life.must_fail.add("notice dropped")
        self._log(f"  pull {p.pull_id} of {p.request_id} submitted ({len(p.rows)} rows; fate {p.fate}, notice "
                  f"{p.notice_fate})")

    # -- the trace and failures ---------------------------------------------------------------
    def _log(self, text: str) -> None:
        line = f"#{self.step_no} t={self.now:.3f} {text}"
        self.trace.append(line)
        self.digest.update(line.encode())
        if self.cfg.trace_all:
            print(line, flush=True)

    def fail(self, invariant: str, message: str) -> None:
        raise SimFailure(self.cfg.seed, self.step_no, invariant, message, list(self.trace))

    def _check(self, ok: bool, invariant: str, message: str) -> None:
        if not ok:
            self.fail(invariant, message)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> SimResult:
        with quiet_logs(), torch.inference_mode():
            try:
                while self.arrived < self.cfg.lives:
                    self.step()
                self.drain()
                self.final_checks()
            finally:
                self.close()
        return SimResult(self.cfg.seed, self.arrived, self.step_no, time.perf_counter() - self.started_at,
                         Counter(self.outcomes), Counter(self.stats), self.digest.hexdigest())

    def close(self) -> None:
        for node in self.nodes.values():
            if node.transport is not None:
                node.transport.close()
            r = getattr(node, "reuse", None)
            if r is not None:
                r[0].close()

    def step(self) -> None:
        self.step_no += 1
        for node in self.nodes.values():
            if not node.up and node.down_until is not None and self.now >= node.down_until:
                self._restart(node)
        if self.now >= self.next_poll:
            self._poll()
        acts = self._actions()
        weights = [a[0] for a in acts]
        _, fn, args = self.rng.choices(acts, weights)[0]
        self._moved = False
        fn(*args)
        if fn != self._step_node:
            for node in self.nodes.values():
                node.stalled = False
        for node in list(self.nodes.values()):
            self._exit_if_drained(node)
        # moving the clock or queueing a notice changes nothing the checks look at, unless a
        # pull ran on the way (its hard deadline)
        if self._moved or fn not in (self._tick, self._jump, self._deliver_notice):
            self.check_invariants()

    def _actions(self) -> list:
        c, acts = self.cfg, []
        if not self.draining:
            if len(self.open) < c.concurrency and self.arrived < c.lives:
                acts.append((3.0, self._arrive, ()))
            if self.open:
                acts.append((c.w_abort, self._client_abort, ()))
            for node in self.nodes.values():
                if node.up and c.w_crash:
                    acts.append((c.w_crash, self._crash, (node,)))
                if node.up and c.w_drain and not node.draining:
                    acts.append((c.w_drain, self._drain_node, (node,)))
            if c.w_adversary:
                acts.append((c.w_adversary, self.adversary.act, ()))
            if c.routers:
                acts.append((c.w_rekey, self._rekey, ()))
                if c.w_router_restart:
                    acts.append((c.w_router_restart, self._router_restart, ()))
        if any(r.live and r.stale for r in self.routers):
            acts.append((1.0, self._router_reload, ()))
        acts += self._progress_actions()
        acts.append((1.0, self._tick, ()))
        acts.append((c.w_jump, self._jump, ()))
        return acts

    def _progress_actions(self) -> list:
        """What can move the cluster on without new requests or time passing (also all the
        drain may do): node steps, handoffs, pulls, notices, router messages."""
        acts = [(4.0, self._step_node, (node,)) for node in self.nodes.values()
                if node.up and self._has_work(node)]
        if any(lf.stage == "handoff" for lf in self.open):
            acts.append((3.0, self._handoff, ()))
        if self.transport.ready(self.now):
            acts.append((3.0, self._run_pull, ()))
        if self.transport.notices:
            acts.append((3.0, self._deliver_notice, ()))
        if self.msgs:
            acts.append((3.0, self._deliver_msg, ()))
        if self.dropping:
            acts.append((3.0, self._drop_choice, ()))
        if self.groups and self._choices_ready():
            acts.append((3.0, self._choice_goes, ()))
        if self.forgets:
            acts.append((3.0, self._deliver_forget, ()))
        acts += [(3.0, self._run_retirements, (node,)) for node in self.nodes.values() if node.up and node.retirements]
        return acts

    def _has_work(self, node: Node) -> bool:
        """Would kvfence/server/engine_loop.py run a step now? After a command (a request, an
        abort, an ACK) or a notice, while the engine says it has work, or when its timer is
        due. Otherwise the real loop blocks, and so does the node here: it is not stepped."""
        if node.poked:
            return True
        eng = node.engine
        t = eng.next_timer()
        if t is not None and t <= node.clock():
            return True
        if node.stalled:   # the real loop would spin on it without effect
            return False
        return eng.has_unfinished() or (node.role == "decode" and not node.link.notices.empty())

    # -- time -------------------------------------------------------------------------------------
    def _advance(self, dt: float) -> None:
        target = self.now + dt
        for p in sorted(self.transport.due(target), key=lambda q: q.hard_deadline):
            # the transfer engine's hard timeout: the pull has run by its deadline
            self.now = max(self.now, p.hard_deadline - 1e-6)
            self._log(f"pull {p.pull_id} of {p.request_id} reaches its hard deadline")
            self.transport.run(p, self.rng)
            self._moved = True
            self.check_invariants()
        self.now = max(self.now, target)

    def _tick(self) -> None:
        dt = self.rng.uniform(0.0005, self.settings.pull_give_up_s / 20)
        self._log(f"tick +{dt:.3f}s")
        self._advance(dt)

    def _jump(self) -> None:
        s = self.settings
        dt = self.rng.choice([self.rng.uniform(0.0, s.max_pull_s / 4),
                              self.rng.uniform(1.0, s.pull_give_up_s * 1.5), self.rng.uniform(1.0, s.lease_s * 1.5),
                              self.rng.uniform(s.lease_s, s.lease_s + s.max_pull_s + 2 * s.clock_skew_s + 5)])
        self._log(f"jump +{dt:.2f}s")
        self._advance(dt)

    # -- the router ---------------------------------------------------------------------------
    def _arrive(self) -> None:
        c, r = self.cfg, self.rng
        i = self.arrived
        self.arrived += 1
        vocab = self.loaded.model.config.vocab_size
        ctx_p, ctx_d = c.context, c.decode_context or c.context
        limit = min(ctx_p, ctx_d)
        u = r.random()
        max_tokens = r.randint(1, c.max_gen)
        if u < c.one_token:
            n = 1
        elif u < c.one_token + c.over_length:
            n = r.randint(max(2, limit - max_tokens - 3), limit + 8)
        else:
            n = r.randint(2, max(2, limit - max_tokens))
        ids = []
        if n >= 2 and r.random() < c.prefix_share:
            ids = list(r.choice(self.prefixes))[:n]
        ids += [r.randrange(2, vocab) for _ in range(n - len(ids))]
        params = SamplingParams(max_tokens=max_tokens, temperature=r.choice([0.0, 1.0]), seed=r.randrange(2**31),
                                ignore_eos=r.random() < 0.5)
        tenant = f"tenant{r.randrange(c.tenants)}"
        # n choices (drawn only when configured: runs without them replay as before); choice j
        # samples with seed + j, as the server sends it
        k = r.randint(2, c.max_choices) if c.choices and r.random() < c.choices else 1
        # the server refuses more choices than a tenant's waiting places (400 too_many_choices,
        # the model card's max_choices): a request for more never reaches the router
        k = min(k, self.max_choices)
        self.arrived += k - 1
        lead = f"s{c.seed}-r{i}"
        group = [Life(i + j, f"s{c.seed}-r{i + j}", tenant, ids,
                      params if j == 0 else dataclasses.replace(params, seed=params.seed + j),
                      over_p=n + max_tokens > ctx_p, over_d=n + max_tokens > ctx_d,
                      request=lead if k > 1 else "", after=lead if j else "") for j in range(k)]
        for life in group:
            self.lives[life.rid] = life
            self.open.append(life)
        if k > 1:
            self.groups[lead] = [lf.rid for lf in group]
            self.stats["choice_requests"] += 1
            self.stats["choices"] += k
        live = [rt for rt in self.routers if rt.live]
        if live:   # the router process that checks its key: the party and the stamp it gives
            rt = self.srng.choice(live)
            for life in group:
                life.router, life.epoch = rt.id, rt.epochs.get(tenant, 0)
                life.party = (tenant, rt.parties[tenant])
        checked = r.random() < c.router_check
        over = " (over-length)" if group[0].over_p or group[0].over_d else ""
        self._log(f"arrive {lead} {tenant} prompt {n} max_tokens {max_tokens}{over}"
                  f"{'' if checked else ' (router check skipped)'}"
                  f"{f' n={k}: ' + ' '.join(lf.rid for lf in group[1:]) if k > 1 else ''}")
        for life in group:   # the server submits every choice at once (kvfence/server/app.py)
            if life.done:
                continue
            if not self.fleet.ready:   # RouterBackend.submit
                life.excuses |= {"crash", "fleet"}
                self._answer(life, "error", "not_ready")
            elif checked and not faults.active("skip_router_admission") and n + max_tokens > self.advertised:
                self._answer(life, "error", "context_length_exceeded", where="router")
            elif life.after and life.after not in self.prompt_held:
                life.stage = "after"   # RouterBackend._run: waits until its first choice's prompt is held
            else:
                self._begin(life)

    def _begin(self, life: Life) -> None:
        """RouterBackend._attempt: prefill, or a one-token prompt straight to decode."""
        if len(life.ids) < 2:
            life.stage = "handoff"   # the router sends a one-token prompt straight to decode
            self.prompt_held.add(life.origin)
            return
        self._route_prefill(life)

    def _choice_goes(self) -> None:
        """A later choice's wait ends: its first choice's prompt is held on prefill (or that
        choice ended), so its own prefill attaches those pages from prefill's cache."""
        life = self.rng.choice(self._choices_ready())
        self._log(f"choice {life.rid} of {life.client} goes")
        self._begin(life)

    def _choices_ready(self) -> list[Life]:
        return [lf for lf in self.open if lf.stage == "after" and lf.after in self.prompt_held]

    def _drop_choice(self) -> None:
        """kvfence/server/app.py: a choice failed (refused before its submit returned, or after,
        while the others generate), so the request fails and the server aborts its other choices
        (the router cancels them as if their client left)."""
        rid = self.dropping.pop(self.rng.randrange(len(self.dropping)))
        life = self._current(rid)
        if life.done:
            return
        self.stats["choices_dropped"] += 1
        if life.verified or life.stage == "decode":
            self.stats["choices_dropped_while_generating"] += 1
        self._log(f"server aborts {life.rid} (stage {life.stage}): another choice of {life.client} failed")
        self._abort(life, "dropped", "choice_dropped")

    def _current(self, rid: str) -> Life:
        """The life the router's task for request `rid` runs now (its redo once it was redone)."""
        life = self.lives[rid]
        return self.lives[rid + ".redo"] if life.result == "redone" else life

    def _refused(self, life: Life, node: Node) -> tuple[str, str] | None:
        """What a node answers before its stream opens (kvfence/pd/node.py and the router's
        _open): unreachable, draining, or another boot than the router checked; None when it
        takes the request."""
        if not node.up:
            life.excuses.add("crash")
            return "node_unavailable", "unreachable (ConnectError)"
        if node.draining:
            life.excuses.add("fleet")
            return "draining", "node is draining"
        why = unchecked_boot(node.fnode.boot_id, node.link.boot_id)
        if why:
            self.stats["fleet_unchecked_boot_refused"] += 1
            life.excuses.add("fleet")
            self.fleet.recheck(node.fnode, why)
            return "not_ready", "a boot the router has not checked"   # (boot ids are random: not in the trace)
        return None

    def _route_prefill(self, life: Life) -> None:
        """RouterBackend._prefill_on_some_node: the fleet picks; a node that refuses before
        taking the request, or dies before holding its KV, costs one retry on another."""
        fn = self.fleet.pick_prefill(life.tenant, life.ids, self.fleet.reference.page_size,
                                     frozenset(life.p_excluded))
        if fn is None:
            life.excuses.add("fleet")
            return self._answer(life, "error", "node_unavailable", where="router")
        p = self._route(life, "p", fn)
        refused = self._refused(life, p)
        if refused is not None:
            self._log(f"  {p.name} refuses {life.rid}: {refused[1]}")
            return self._prefill_failed(life, *refused)
        n, max_tokens = len(life.ids), life.params.max_tokens
        refused = self._admit_scope(life, p)
        if refused == "scope_retired":
            self._unroute(life, "p")
            return self._answer(life, "error", "scope_retired", where=p.name)
        if refused is not None:   # in the stream, as the router sees it: its rule for a retry
            return self._prefill_failed(life, refused, "its cache scope could not be retired")
        granted = p.engine.ledger.counters["pages_allocated"]
        try:
            seq = p.engine.add_request(life.ids, life.params, tenant=life.tenant, request_id=life.rid, hold_kv=True,
                                       router=life.router or None)
        except (ContextLengthExceeded, Overloaded) as e:
            self._check(p.engine.ledger.counters["pages_allocated"] == granted and life.rid not in p.engine.requests,
                        "I4", f"prefill allocated for {life.rid} although it rejected it")
            if isinstance(e, Overloaded):   # refused for load before admitting: another node may take it
                self.stats["overloaded_prefill"] += 1
                self._check_shed(p, life)
                self._log(f"  {p.name} refuses {life.rid}: overloaded")
                return self._prefill_failed(life, "server_overloaded", str(e))
            self._unroute(life, "p")
            return self._answer(life, "error", "context_length_exceeded", where=p.name)
        except ValueError as e:
            self.fail("router", f"prefill refused {life.rid}: {e}")
        self._check(n + max_tokens <= p.engine.usable_context or not self.cfg.check_admission, "I4",
                    f"{p.name} admitted {life.rid} although prompt + max_tokens = {n + max_tokens} exceeds its "
                    f"usable context {p.engine.usable_context} (seq state {seq.state.value})")
        self._check_party(life, p, seq)
        life.p_owner = seq.owner.request
        self._names[seq.owner.request] = f"{life.rid}@{p.name}"
        p.poked = True
        life.p_sink = True
        life.stage = "prefill"
        self._log(f"  {life.rid} -> {p.name}")

    def _prefill_failed(self, life: Life, code: str, message: str) -> None:
        """A prefill attempt failed before the KV was held: retry on another node if the
        router would, else answer the client."""
        self._unroute(life, "p")
        life.p_sink = False
        life.p_excluded.add(life.p_node)
        retry = may_retry_prefill(code, life.manifest is not None, life.p_tries)
        life.p_tries += 1
        other = self.fleet.pick_prefill(life.tenant, life.ids, self.fleet.reference.page_size,
                                        frozenset({life.p_node}))
        if retry and other is not None:
            self._log(f"  {life.rid}: prefill on {life.p_node} failed ({code}); trying another")
            life.stage = "new"
            return self._route_prefill(life)
        self._answer(life, "error", code, where=life.p_node)

    def _route(self, life: Life, side: str, fn) -> Node:
        """The router's _routed context begins: the fleet's pick counts this request, and
        the life records which node (and boot) it went to."""
        node = self.nodes[fn.url]
        setattr(life, f"{side}_node", node.name)
        setattr(life, f"{side}_boot", node.boot)
        setattr(life, f"{side}_flight", fn)
        fn.in_flight += 1
        fn.routed += 1
        return node

    def _unroute(self, life: Life, side: str) -> None:
        """The router's _routed context ends: the node no longer counts this request."""
        fn = getattr(life, f"{side}_flight")
        if fn is not None:
            fn.in_flight -= 1
            setattr(life, f"{side}_flight", None)

    def _handoff(self) -> None:
        life = self.rng.choice([lf for lf in self.open if lf.stage == "handoff"])
        self._log(f"router -> decode {life.rid}")
        source = None
        if life.manifest is not None:   # RouterBackend._handoff: the prefill node's facts as the monitor saw them
            info = self.fleet.by_url(life.p_node).info
            if info is None or info.pd.boot_id != life.manifest["boot_id"]:
                life.excuses.add("crash")   # the prefill node restarted after holding
                return self._fail_handoff(life, "node_failed", "prefill")
            source = {"session": info.pd.transfer_session, "base": info.pd.buffer_base, "boot_id": info.pd.boot_id}
        self._route_decode(life, source)

    def _route_decode(self, life: Life, source: dict | None) -> None:
        """RouterBackend._decode_on_some_node: the fleet picks; a node that refuses before
        admitting (or is unreachable) costs one retry on another, with the same handoff."""
        fn = self.fleet.pick_decode(frozenset(life.d_excluded))
        if fn is None:
            life.excuses.add("fleet")
            return self._answer(life, "error", "node_unavailable", where="router")
        d = self._route(life, "d", fn)
        life.decode_contacted, life.reader_stopped = True, False
        refused = self._refused(life, d)
        if refused is not None:
            life.reader_stopped = True   # refused or never reached: it never pulls
            return self._decode_elsewhere(life, d, *refused, source)
        kw = ({"kv_source": {"manifest": dict(life.manifest), "source": source, "choice_of": life.client}}
              if life.manifest is not None else {})
        refused = self._admit_scope(life, d)
        if refused is not None:
            life.reader_stopped = True   # refused: it never pulls
            if refused == "engine_unavailable":   # behind a failed retirement: refused before admitting
                return self._decode_elsewhere(life, d, refused, refused, source)
            return self._answer(life, "error", refused, where=d.name)
        granted = (d.engine.ledger.counters["pages_allocated"], d.link.staging.ledger.counters["pages_allocated"])
        try:
            seq = d.engine.add_request(life.ids, life.params, tenant=life.tenant, request_id=life.rid,
                                       router=life.router or None, **kw)
        except (ContextLengthExceeded, ManifestError, Overloaded) as e:
            now = (d.engine.ledger.counters["pages_allocated"], d.link.staging.ledger.counters["pages_allocated"])
            self._check(now == granted and life.rid not in d.engine.requests, "I4",
                        f"{d.name} reserved pages or rows for {life.rid} although it refused it")
            life.reader_stopped = True   # decode answered and refused: it never pulls
            if isinstance(e, Overloaded):   # refused for load before admitting: another decode node may take it
                self.stats["overloaded_decode"] += 1
                self._check_shed(d, life)
                return self._decode_elsewhere(life, d, "server_overloaded", "server_overloaded", source)
            if isinstance(e, ContextLengthExceeded):
                return self._answer(life, "error", "context_length_exceeded", where=d.name)
            self._log(f"  {d.name} refused the manifest: {e}")
            return self._answer(life, "error", "kv_manifest_invalid")
        except ValueError as e:
            self.fail("router", f"decode refused {life.rid}: {e}")
        need = len(life.ids) + life.params.max_tokens
        self._check(need <= d.engine.usable_context or not self.cfg.check_admission, "I4",
                    f"{d.name} admitted over-length {life.rid}")
        self._check(life.manifest is not None or len(life.ids) == 1, "I4",
                    f"{life.rid} reached decode without a manifest")
        self._check_party(life, d, seq)
        life.d_owner = seq.owner.request
        together = d.link._requests.get((life.tenant, life.client))
        if life.request and together is not None and together[1] >= 2:
            self.stats["decode_choices_held_together"] += 1
        self._names[seq.owner.request] = f"{life.rid}@{d.name}"
        d.poked = True
        life.d_sink = True
        life.stage = "decode"
        self._log(f"  {life.rid} -> {d.name}")

    def _decode_elsewhere(self, life: Life, d: Node, code: str, why: str, source: dict | None) -> None:
        """Decode was not reached, or refused the request for load or state before admitting it
        (the router's NodeError.retryable, REFUSED_FOR_LOAD_OR_STATE): once more on another
        decode node."""
        self._log(f"  {d.name} refuses {life.rid}: {why}")
        self._unroute(life, "d")
        life.d_excluded.add(d.name)
        retry = may_retry_decode(code, True, False, life.d_tries)
        life.d_tries += 1
        if retry and self.fleet.pick_decode(frozenset({d.name})) is not None:
            return self._route_decode(life, source)
        self._answer(life, "error", code, where=d.name)

    def _check_shed(self, node: Node, life: Life) -> None:
        """A refusal for load (LLMEngine._check_load) is true: the node's queue is full, or the
        tenant holds its share of it, counting only requests the node still has; and it took
        nothing of this one (no pages or rows: checked by the caller; not queued anywhere)."""
        eng = node.engine
        queued = list(eng.scheduler.waiting) + eng.kv_link.queued()
        self._check(all(q.request_id in eng.requests and not q.finished for q in queued), "leak",
                    f"{node.name}'s queue holds requests it no longer has: "
                    f"{[q.request_id for q in queued if q.request_id not in eng.requests][:5]}")
        mine = sum(1 for q in queued if q.tenant == life.tenant)
        full = len(queued) >= eng.config.max_waiting or mine >= eng.config.tenant_waiting_places
        self._check(full, "outcome", f"{node.name} refused {life.rid} for load with {len(queued)} waiting "
                                     f"({mine} of its tenant's; max_waiting {eng.config.max_waiting})")
        self._check(all(q.request_id != life.rid for q in queued), "I4",
                    f"{node.name} refused {life.rid} for load but queued it")
        life.excuses.add("load")

    def _fail_handoff(self, life: Life, code: str, culprit: str | None) -> None:
        """RouterBackend._run: a failure that names a failed node (culprit) before anything
        reached the client has the request done again without that node, when the fleet has
        another of its role and one of the other (_redo_avoiding); else the client's error."""
        if may_redo(culprit, life.manifest is not None, life.verified, life.redone):
            assert culprit is not None
            avoid = nodes_to_avoid(culprit, life.p_node or None, life.d_node or None,
                                   ready_elsewhere(self.fleet, life.tenant, life.ids))
            if avoid is not None:
                return self._redo(life, code, avoid.get("prefill", frozenset()), avoid.get("decode", frozenset()))
        self._answer(life, "error", code)

    def _redo(self, life: Life, code: str, p_ex: frozenset[str], d_ex: frozenset[str]) -> None:
        """The first attempt ends for the nodes as an answered one does (_answer: prefill's abort,
        or decode asked first); the client waits on the redo, a new request to the nodes."""
        self._answer(life, "redone", code)
        again = Life(life.n, f"{life.rid}.redo", life.tenant, life.ids, life.params, over_p=life.over_p,
                     over_d=life.over_d, redone=True, p_excluded=set(p_ex), d_excluded=set(d_ex),
                     p_tries=len(p_ex), d_tries=len(d_ex), router=life.router, epoch=life.epoch, party=life.party,
                     request=life.request)
        self.lives[again.rid] = again
        self.open.append(again)
        self.stats["redone"] += 1
        if life.request:
            self.stats["choice_redone"] += 1
        self._log(f"  redo {life.rid} as {again.rid} without {sorted(p_ex | d_ex)}")
        self._route_prefill(again)

    def _client_abort(self) -> None:
        picked = self.rng.choice(self.open)
        group = self.groups.get(picked.client)
        # the client of n choices has one connection: every choice still running ends with it
        for life in [picked] if group is None else [self._current(rid) for rid in group]:
            if not life.done:
                self._log(f"client disconnects {life.rid} (stage {life.stage})")
                self._abort(life, "gone", "client_abort")

    def _abort(self, life: Life, result: str, excuse: str) -> None:
        """The router cancels the request's task (RouterBackend.abort)."""
        life.excuses.add(excuse)
        stage = life.stage
        self._answer(life, result)
        # the node whose stream the router held sees it close and aborts the request there
        if stage == "prefill":
            self.msgs.append(Msg("drop", life.p_node, life.rid, life.p_boot))
        elif stage == "decode":
            self.msgs.append(Msg("drop", life.d_node, life.rid, life.d_boot))

    def _answer(self, life: Life, result: str, code: str | None = None, reason: str | None = None,
                where: str | None = None) -> None:
        """The router is done with this request: the client's answer, then the router's
        `finally` (an abort to prefill unless decode acknowledged the transfer)."""
        # its submit had returned (kvfence/pd/router.py: decode verified the KV, or took a
        # one-token prompt): counted apart, a choice failing before or after it
        admitted = life.verified or (len(life.ids) < 2 and life.stage == "decode")
        life.result, life.code, life.finish_reason = result, code, reason
        life.router_live = False
        life.stage = "done"
        self.open.remove(life)
        self._unroute(life, "p")
        self._unroute(life, "d")
        key = ("200 " + reason if result == "200" else "client gone" if result == "gone" else
               "choice dropped (another failed)" if result == "dropped" else
               f"redone after {code}" if result == "redone" else f"error {code}")
        if result != "redone":   # outcomes are the clients' answers: a redone life's is its redo's
            self.outcomes[key] += 1
        self._log(f"  answer {life.rid}: {key}{' at ' + where if where else ''}")
        if life.manifest is not None and not life.released and not life.abort_posted:
            life.abort_posted = True
            stopped = life.reader_stopped or not life.decode_contacted
            if stopped:
                self.msgs.append(Msg("abort", life.p_node, life.rid, self._boot_of(life.p_node), True))
            else:   # RouterBackend._settle_prefill: ask decode first
                self.msgs.append(Msg("stop_pull", life.d_node, life.rid, life.d_boot))
        if result != "redone":   # its task ends: a later choice waiting for it goes on
            self.prompt_held.add(life.origin)
        group = self.groups.get(life.client)
        if group is not None and result == "error":   # one choice failed: so does the request (app.py _Run)
            self.stats["choice_failed_" + ("admitted" if admitted else "before_admission")] += 1
            self.dropping += [rid for rid in group if rid != life.origin and not self._current(rid).done]
        self._judge(life, where)

    def _judge(self, life: Life, where: str | None) -> None:
        """A request ends with an error exactly when something the simulation injected
        explains it; an over-length request never gets a 200 (I4); one that fits the
        advertised context never reaches a node too small for it (I8). `where`: the router
        or the node that answered."""
        if life.result in ("gone", "dropped") or not self.cfg.check_admission:
            return
        if life.result == "redone":   # the client got nothing of it; still, only an injected fault may cause one
            self._check(bool(EXPLAINED_BY.get(life.code or "", set()) & life.excuses), "outcome",
                        f"{life.rid} was redone after {life.code} but nothing the simulation injected explains it")
            return
        if life.result == "200":
            self._check(not (life.over_p or life.over_d), "I4", f"over-length {life.rid} got a 200")
            self._check(not life.must_fail, "I5", f"{life.rid} got a 200 although the simulation injected "
                        f"{sorted(life.must_fail)} into its transfer")
            self._check(len(life.ids) < 2 or life.verified, "I5", f"{life.rid} got a 200 without a verified transfer")
            return
        if life.code == "context_length_exceeded":
            node = self.nodes.get(where or "")
            need = len(life.ids) + life.params.max_tokens
            if node is None:   # the router's own check
                over = life.over_p or life.over_d
            else:
                self._check(need > self.advertised, "I8",
                            f"{life.rid} (prompt + max_tokens = {need}) fits the advertised context {self.advertised} "
                            f"but was routed to {node.name}, whose usable context is {node.engine.usable_context}: "
                            f"a node below the advertised context must be refused")
                over = life.over_p if node.role == "prefill" else life.over_d
            self._check(over, "I4", f"{life.rid} was refused as over-length at {where} although it fits")
            return
        # a node refuses what is queued behind a failed retirement of its scope before its own
        # admission looks at the request (kvfence/pd/node.py): an over-length one gets that 503
        excused = (bool(life.excuses & {"crash", "client_abort", "fleet", "rekey"})
                   or (life.code == "server_overloaded" and "load" in life.excuses)
                   or (life.code == "engine_unavailable" and "retire_fail" in life.excuses))
        self._check(not (life.over_p or life.over_d) or excused, "I4",
                    f"over-length {life.rid} was not refused with a 400 (got {life.code})")
        why = EXPLAINED_BY.get(life.code, set())
        self._check(bool(why & life.excuses), "outcome",
                    f"{life.rid} ended with error {life.code} but nothing the simulation injected explains it "
                    f"(injected: {sorted(life.excuses) or 'nothing'})")

    # -- node steps and their outputs ---------------------------------------------------------------
    @staticmethod
    def _signature(node: Node) -> tuple:
        eng, link = node.engine, node.link
        return (sum(eng.ledger.counters.values()), sum(link.staging.ledger.counters.values()), len(eng.requests),
                sum(s.num_computed + len(s.output_ids) for s in eng.requests.values()),
                len(getattr(link, "pending", ())), len(getattr(link, "waiting", ())), len(getattr(link, "live", ())))

    def _step_node(self, node: Node) -> None:
        # an engine step takes time (also while draining: a node that spins without progress,
        # e.g. preempting and recomputing a prompt until a fence lifts, must see time pass)
        self._advance(self.rng.uniform(0.0, self.settings.pull_give_up_s / 100))
        before = self._signature(node)
        node.poked = False
        self._staged_plain.clear()
        self._run_retirements(node)   # the engine runs the commands queued before its step
        routers = len(node.engine.realms)
        outs = node.engine.step()
        self.stats["scope_idle_routers_retired"] += routers - len(node.engine.realms)   # silent past router_idle_s
        node.stalled = not outs and self._signature(node) == before
        self._log(f"step {node.role}: {len(outs)} outputs{' (nothing moved)' if node.stalled else ''}")
        if node.role == "prefill":
            self._on_prefill(node, outs)
        else:
            self._on_decode(node, outs)
        if node.up:
            self._check_progress(node)

    def _on_prefill(self, node: Node, outs) -> None:
        for out in outs:
            life = self.lives[out.seq.request_id]
            if (node.name, node.boot) != (life.p_node, life.p_boot):
                self.fail("router", f"{node.name} (boot {node.boot}) has {life.rid}, which the router routed to "
                                    f"{life.p_node} (boot {life.p_boot})")
            if out.finished:
                life.p_sink = False
            if out.event == "kv_held":
                m = out.data
                life.held = m
                # the content oracle's truth: the plaintext prefill sealed for this hold
                life.truth = self._staged_plain.popleft() if self._staged_plain else None
                self._log(f"  {life.rid} kv_held: {m['token_count']} tokens in rows {m['slots']}")
                self._check(m["token_count"] == len(life.ids) - 1 or not self.cfg.check_handoff, "I5",
                            f"prefill held {m['token_count']} tokens of {life.rid}, its prompt has {len(life.ids)}")
                if life.router_live and life.stage == "prefill":
                    life.manifest = m
                    life.stage = "handoff"
                    self._unroute(life, "p")   # RouterBackend._prefill returns with the manifest
                    self.prompt_held.add(life.origin)   # its later choices go
                    # every whole page of its prompt from the cache: its first choice's (or an
                    # identical prompt's), not only a shared prefix's
                    whole = (len(life.ids) - 1) // self.cfg.page_size * self.cfg.page_size
                    if life.after and whole and out.seq.cached_tokens >= whole:
                        self.stats["choice_whole_prompt_attached"] += 1
            elif out.finished and life.router_live and life.stage == "prefill":
                code = out.seq.abort_code or "prefill_failed"
                self._known_pool_bug(node, life, code)
                self._log(f"  prefill failed {life.rid}: {out.seq.error}")
                self._prefill_failed(life, code, out.seq.error or code)

    def _on_decode(self, node: Node, outs) -> None:
        for out in outs:
            life = self.lives[out.seq.request_id]
            if (node.name, node.boot) != (life.d_node, life.d_boot):
                self.fail("router", f"{node.name} (boot {node.boot}) has {life.rid}, which the router routed to "
                                    f"{life.d_node} (boot {life.d_boot})")
            if out.finished:
                life.d_sink = False
            if out.event == "kv_verified":
                self._verified(node, life, out)
            elif out.event == "kv_failed":
                self._log(f"  {life.rid} kv_failed ({out.seq.abort_code}): {out.seq.error}")
                if life.router_live:
                    life.reader_stopped = bool((out.data or {}).get("reader_stopped"))
            if out.new_token_ids:
                self._check(len(life.ids) < 2 or life.verified, "I5",
                            f"decode generated for {life.rid} without a verified transfer")
                life.tokens += out.new_token_ids
            if out.finished and life.router_live and life.stage == "decode":
                seq = out.seq
                if seq.finish_reason in ("stop", "length"):
                    self._check(1 <= len(life.tokens) <= life.params.max_tokens, "outcome",
                                f"{life.rid} finished with {len(life.tokens)} tokens, max_tokens "
                                f"{life.params.max_tokens}")
                    self._answer(life, "200", reason=seq.finish_reason)
                    continue
                code = seq.abort_code or seq.finish_reason
                self._log(f"  decode ended {life.rid}: {code}: {seq.error}")
                self._known_pool_bug(node, life, code)
                m = life.manifest
                if code == "lease_expired":
                    ok = m is not None and node.clock() >= m["lease_deadline"] - self.cfg.clock_skew_s
                    self._check(ok, "I6", f"decode gave up on {life.rid}'s lease before it ran out")
                    life.excuses.add("slow")
                elif code == "kv_transfer_timeout":
                    ok = life.pull_started is not None and node.clock() - life.pull_started > self.cfg.pull_give_up_s
                    self._check(ok, "outcome", f"decode timed out {life.rid}'s pull early")
                    life.excuses.add("slow")
                self._fail_handoff(life, code, culprit_of_decode_failure(code))

    def _known_pool_bug(self, node: Node, life: Life, code: str) -> None:
        if code != "kv_pool_exhausted":
            return
        if self._unservable.pop(life.rid, False):
            self.stats[f"known_bug_pool_held_outside_scheduler_{node.role}"] += 1
            if "pool_held_outside_scheduler" in self.cfg.known_bugs:
                life.excuses.add("known_bug_pool_held_outside_scheduler")

    def _verified(self, node: Node, life: Life, out) -> None:
        tokens = out.data["tokens"]
        self._log(f"  {life.rid} kv_verified ({tokens} tokens)")
        self._check(tokens == len(life.ids) - 1 or not self.cfg.check_handoff, "I5",
                    f"decode verified {tokens} tokens for {life.rid}, whose prompt has {len(life.ids)}")
        self._check(not life.verified, "I5", f"{life.rid} verified twice")
        kv = self._unstaged.pop(life.d_owner, None)
        self._check(kv is not None and life.truth is not None, "I5",
                    f"{life.rid} verified but the simulation saw no copy into its pool pages")
        # the content oracle: decode's pool now holds exactly what prefill staged for this request
        L, two, H, _, D = kv.shape
        ps = self.cfg.page_size
        n = life.truth.shape[0]
        kv = kv.clone()
        node.engine.pool.clear_positions_from(kv, tokens)  # prefill zeroes the same tail when it stages
        got = kv.view(L, two, H, n, ps, D).permute(3, 0, 1, 2, 4, 5).contiguous().view(n, -1).view(torch.uint8)
        want = life.truth.view(n, -1)
        if self.cfg.check_handoff and not torch.equal(got[:, :want.shape[1]], want):
            bad = int((got != want).any(dim=1).nonzero()[0])
            self.fail("I5", f"decode verified {life.rid}, but its pool page {bad} does not hold the KV prefill "
                            f"staged for it (an unverified or foreign transfer reached the pool)")
        life.verified = True
        if life.router_live:
            life.released = True
            self.msgs.append(Msg("release", life.p_node, life.rid, self._boot_of(life.p_node)))

    # -- the transfer engine and messages -------------------------------------------------------------
    def _run_pull(self) -> None:
        p = self.rng.choice(self.transport.ready(self.now))
        self._log(f"pull {p.pull_id} of {p.request_id} runs ({p.fate})")
        self.transport.run(p, self.rng)
        if p.error:
            self._log(f"  {p.error}")

    def _deliver_notice(self) -> None:
        n = self.rng.choice(self.transport.notices)
        self._log(f"notice of pull {n.pull_id} ({n.request_id}, ok={n.notice[1]}) delivered")
        self.transport.deliver(n)
        for node in self.nodes.values():   # the real pull wakes its engine loop (engine.wake())
            if node.link is n.importer:
                node.poked = True

    def _deliver_msg(self) -> None:
        m = self.rng.choice(self.msgs)
        self.msgs.remove(m)
        self.delivered.append(m)
        node = self.nodes[m.node]
        life = self.lives[m.rid]
        if node.up and node.boot == m.boot:
            node.poked = True   # kvfence/server/engine_loop.py steps the engine after every command
        if not node.up or node.boot != m.boot:  # sent to a process that is gone (or was down): the POST failed
            self._log(f"{m.kind} {m.rid} -> {m.node}: lost (node gone)")
            if m.kind == "stop_pull":   # no answer: the router tells prefill a read may still run
                self.stats["stop_pull_unanswered"] += 1
                self.msgs.append(Msg("abort", life.p_node, m.rid, self._boot_of(life.p_node), False))
            return
        if m.kind == "stop_pull":   # kvfence/pd/node.py /internal/stop_pull: abort, then the question
            if life.d_sink:
                node.engine.abort(m.rid, "the router gave up on the request")
                life.d_sink = False
            stopped = node.link.stop_pull(m.rid)
            self._log(f"stop_pull {m.rid} -> {m.node}: reader_stopped={stopped}")
            self.msgs.append(Msg("abort", life.p_node, m.rid, self._boot_of(life.p_node), stopped))
            return
        if m.kind == "drop":  # kvfence/pd/node.py: the stream closed before the request finished
            open_ = life.p_sink if node.role == "prefill" else life.d_sink
            self._log(f"{m.node} sees the router's stream for {m.rid} close{'' if open_ else ' (already done)'}")
            if open_:
                node.engine.abort(m.rid, "router disconnected")
                if node.role == "prefill":
                    life.p_sink = False
                else:
                    life.d_sink = False
        elif m.kind == "release":
            r = node.engine.release_kv(m.rid)
            self._log(f"ACK {m.rid} -> {m.node}: {r}")
        else:
            # /internal/abort: the engine loop's abort (only while the prefill stream is open), then the link's
            if life.p_sink and life.p_boot == node.boot:
                node.engine.abort(m.rid, "the request ended before decode verified the transfer")
                life.p_sink = False
            r = node.engine.abort_kv(m.rid, m.reader_stopped, "the request ended before decode verified the transfer")
            self._log(f"abort {m.rid} -> {m.node} (reader_stopped={m.reader_stopped}): {r}")

    # -- the checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for node in self.nodes.values():
            if node.up:
                self._check_node(node)
        self._check_in_flight()

    def _check_node(self, node: Node) -> None:
        eng, link, role = node.engine, node.link, node.role
        led, rows = eng.ledger, link.staging.ledger
        full = self.step_no % self.cfg.full_check_every == 0
        for name, lg in (("pool", led), ("transfer buffer", rows)):
            try:
                if full:
                    lg.check_consistency()
                else:
                    fast_consistency(lg)
            except Exception as e:  # noqa: BLE001
                self.fail("I1", f"{role} {name} ledger inconsistent: {e}")
        # I1: every owned page has a live owner, and every live request's pages are its own
        live = {s.owner.request: s for s in eng.requests.values()}
        pages, epochs, reqs, scopes = [], [], [], []
        for s in live.values():
            if s.state in TERMINAL:
                self.fail("I1", f"{role}: ended request {s.request_id} still registered")
            n = len(s.table.pages)
            if n:
                pages += s.table.pages
                epochs += s.table.epochs
                reqs += [s.owner.request] * n
                scopes += [s.owner.cache_scope] * n
        if pages:
            pg = np.asarray(pages)
            st = led.state[pg]
            ok = (((st == OWNED) & (led.owner_request[pg] == np.asarray(reqs)))
                  | ((st == SHARED) & (led.owner_tenant[pg] == np.asarray(scopes))))
            ok &= led.epoch[pg] == np.asarray(epochs)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                p = pages[i]
                self.fail("I1", f"{role}: {self._name(reqs[i])}'s block table names page {p} (epoch {epochs[i]}) "
                                f"which is {PageState(led.state[p]).name} of {self._name(led.owner_request[p])}, epoch "
                                f"{led.epoch[p]}")
        owned = np.flatnonzero(led.state == OWNED)
        if len(owned):
            orphans = [int(pg) for pg in owned if int(led.owner_request[pg]) not in live]
            self._check(not orphans, "I1", f"{role}: pool pages {orphans} owned by no live request")
        self._check(not (led.state == QUARANTINED).any() and not led.violations,
                    "I3" if led.violations.get("I3") else "I2",
                    f"{role}: the ledger's read check fired ({dict(led.violations)}) or quarantined pool pages "
                    f"({led.num_quarantined}): a defense had to stop something upstream")
        audit = eng.runner.audit
        if audit.counters["violations"]:
            v = audit.violations[0]
            inv = "I3" if v.kind == "read_unwritten" else "I2"  # noqa: E501
            self.fail(inv, f"{role} read audit: request {v.request_id} {v.kind.replace('_', ' ')} on page {v.page} "
                           f"slots {v.first_slot}..{v.last_slot}; ledger: {v.page_state} of "
                           f"{self._name(v.page_owner_request)}, {v.page_written} slots written")
        # transfer-buffer rows: owned rows belong to a live hold (prefill) or live pull (decode)
        if role == "prefill":
            holders = {h.owner.request: h for h in link.held.values()}
            for rid in link.held:
                self._check(rid in eng.requests and eng.requests[rid].state is State.KV_HELD, "I1",
                            f"prefill holds rows for {rid}, which is not KV_HELD")
        else:
            holders = {link.pulls[pid].owner.request: link.pulls[pid] for pid in link.live.values()}
            for rid in link.live:
                self._check(rid in eng.requests and eng.requests[rid].state is State.AWAITING_KV, "I1",
                            f"decode has a live pull for {rid}, which is not AWAITING_KV")
        owned = np.flatnonzero(rows.state == OWNED)
        orphans = [int(r) for r in owned if int(rows.owner_request[r]) not in holders]
        self._check(not orphans, "I1", f"{role}: transfer-buffer rows {orphans} owned by no live hold or pull")
        fenced = set()
        for pages, _ in rows._fences.values():
            fenced.update(pages)
        quarantined = set(np.flatnonzero(rows.state == QUARANTINED).tolist())
        self._check(quarantined == fenced, "I6", f"{role}: quarantined rows {sorted(quarantined)} differ from the "
                    f"fenced rows {sorted(fenced)}")

    def _name(self, owner: int) -> str:
        """A request's engine-wide owner number as a name that is the same in every run."""
        owner = int(owner)
        return "nobody" if owner < 0 else self._names.get(owner, "an unknown request")

    def _row_held_by(self, ledger, row: int, owner: int, epoch: int) -> bool:
        st = ledger.state[row]
        if st == OWNED:
            return int(ledger.owner_request[row]) == owner and int(ledger.epoch[row]) == epoch
        if st == QUARANTINED:
            return row in ledger._fences.get(owner, ([], None))[0]
        return False

    def _idle_with_work(self, node: Node, message: str) -> None:
        self.stats[f"known_bug_idle_with_work_{node.role}"] += 1
        if "idle_with_work" not in self.cfg.known_bugs:
            self.fail("liveness", message)
        self._log(f"  known bug idle_with_work: {message}; woken")
        node.poked = True

    def _check_progress(self, node: Node) -> None:
        """After a step, a node that would go idle (no work, so the server loop blocks until a
        command or its next timer) must not leave a queued request behind that it could
        serve now: that request would wait for an unrelated event, or forever."""
        eng, link = node.engine, node.link
        if eng.has_unfinished():
            return
        t = eng.next_timer()
        until = "forever (no timer)" if t is None else f"until its next timer, {t - node.clock():.2f} s away"
        if node.role == "prefill" and link.pending:
            s = link.pending[0]
            rows = link.staging.ledger.num_available
            if eng.ledger.pages_for(s.num_computed) <= rows:
                self._idle_with_work(node, f"prefill goes idle with {s.request_id} waiting for transfer-buffer rows "
                                           f"although {rows} are free: it waits {until}")
        if node.role == "decode" and link.waiting:
            # a tenant at its running share waits while another tenant's could go (its pulls in
            # flight end by a notice or a timer, which wake the node): the oldest request of a
            # tenant under its share, or the oldest of all when every waiting tenant is at it;
            # those in the scheduler's queue (preempted here, or a one-token prompt) go first,
            # except a tenant's that runs fewer than every tenant with one there (docs/pd.md,
            # KvImporter._candidates)
            running = Counter(q.tenant for q in eng.scheduler.running)
            running.update(link.pulls[pid].seq.tenant for pid in link.live.values())
            floor = min((running[q.tenant] for q in eng.scheduler.waiting), default=None)
            may = [q for q in link.waiting if floor is None or running[q.tenant] < floor]
            if not may:
                # they wait for the scheduler's queue; the engine goes idle with work queued only
                # while a pull's reservation holds pool pages (LLMEngine._stalled), which come back
                # by its notice or timer. True by construction today: checked so a change shows
                if not link.live:
                    self._idle_with_work(node, f"decode goes idle with {link.waiting[0].request_id} behind "
                                               f"{eng.scheduler.waiting[0].request_id}, with no pull in flight to "
                                               f"give pages back: it waits {until}")
                return
            s = next((q for q in may if running[q.tenant] < eng.scheduler.max_seqs_per_tenant), may[0])
            m = s.kv_source.manifest
            if node.clock() < m.lease_deadline - self.cfg.clock_skew_s:
                need = eng.ledger.pages_for(len(s.prompt_ids) + s.max_tokens)
                busy = len(eng.scheduler.running) + len(link.live)
                if (busy < eng.config.max_num_seqs and need <= eng.ledger.num_available
                        and m.page_count <= link.staging.ledger.num_available):
                    self._idle_with_work(node, f"decode goes idle with {s.request_id} waiting although its pages "
                                               f"and rows are free: it waits {until}")

    def _check_in_flight(self) -> None:
        """I6: a pull still in flight may write its destination rows and read its source rows;
        none of them may be free or another request's, on either side."""
        links = {id(n.link): n for n in self.nodes.values() if n.up}
        sources = {n.link.boot_id: n for n in self.nodes.values() if n.up and n.role == "prefill"}
        for sp in self.transport.pending:
            if sp.pull.cancelled:   # given up before it began: begin_read refuses it, it reads nothing
                continue
            meta = self._pull_meta[(sp.importer.boot_id, sp.pull_id)]
            owner, epochs, _ = meta
            d = links.get(id(sp.importer))
            if d is not None:
                bad = [r for r, e in zip(sp.rows, epochs) if not self._row_held_by(d.link.staging.ledger, r, owner, e)]
                if bad:
                    led = d.link.staging.ledger
                    self.fail("I6", f"{d.name} rows {bad} of {sp.request_id}'s pull {sp.pull_id}, still in flight, are "
                                    f"{[PageState(led.state[r]).name for r in bad]} (owners "
                                    f"{[self._name(led.owner_request[r]) for r in bad]}): a late write would land "
                                    f"in them")
            m = sp.manifest
            life = self.lives.get(sp.request_id)
            p = sources.get(m.boot_id)
            if p is not None and life is not None:
                led = p.link.staging.ledger
                bad = [r for r, e in zip(m.slots, m.epochs) if not self._row_held_by(led, r, life.p_owner, e)]
                if bad:
                    self.fail("I6", f"{p.name} rows {bad} that {sp.request_id}'s pull {sp.pull_id} (in flight) reads "
                                    f"are "
                                    f"{[PageState(led.state[r]).name for r in bad]} (owners "
                                    f"{[self._name(led.owner_request[r]) for r in bad]}): the pull would read another "
                                    f"request's KV")

    # -- the end ------------------------------------------------------------------------------------
    def drain(self) -> None:
        """No more arrivals, disconnects or crashes: let everything in flight finish, then move
        the clock past every lease, give-up and fence."""
        self.draining = True
        self._log("DRAIN")
        self._settle_nodes()
        idle_rounds = 0
        for _ in range(self.cfg.drain_steps):
            self.step_no += 1
            acts = self._progress_actions()
            if acts:
                idle_rounds = 0
                _, fn, args = self.rng.choices(acts, [a[0] for a in acts])[0]
                fn(*args)
                if fn != self._step_node:
                    for node in self.nodes.values():
                        node.stalled = False
                self._settle_nodes()
                self.check_invariants()
                continue
            timers = [t - n.offset for n in self.nodes.values() if (t := n.engine.next_timer()) is not None]
            timers += [p.not_before for p in self.transport.pending]
            if not timers:
                if self.open or idle_rounds > 3:
                    break
                idle_rounds += 1
                continue
            self._log(f"drain: clock to the next timer (+{max(0.0, min(timers) - self.now):.2f}s)")
            self._advance(max(0.0, min(timers) - self.now) + 1e-3)
            for node in self.nodes.values():
                node.stalled = False
                self._step_node(node)
                self.check_invariants()
        else:
            self.fail("liveness", f"the cluster did not settle within {self.cfg.drain_steps} drain steps")

    def _settle_nodes(self) -> None:
        """In the final drain: drained nodes exit and every node that is down comes back at
        once, so that what is in flight can finish; the monitor keeps polling."""
        for node in self.nodes.values():
            self._exit_if_drained(node)
            if not node.up:
                self.now = max(self.now, node.down_until or self.now)
                self._restart(node)
        if self.now >= self.next_poll:
            self._poll()

    def final_checks(self) -> None:
        self._log("FINAL CHECKS")
        for node in self.nodes.values():
            node.engine.ledger.check_consistency()
            node.link.staging.ledger.check_consistency()
        stuck = [lf.rid for lf in self.lives.values() if not lf.done]
        self._check(not stuck, "liveness", f"requests never answered: {stuck[:10]} ({len(stuck)})")
        self._check(not self.transport.pending and not self.transport.notices and not self.msgs, "liveness",
                    "pulls, notices or messages still in flight at the end")
        for node in self.nodes.values():
            eng, link = node.engine, node.link
            left = {rid: s.state.value for rid, s in eng.requests.items()}
            self._check(not left, "liveness", f"{node.name}: requests not terminal at the end: {left}")
            led = eng.ledger
            leaked = int((led.state == OWNED).sum()) + led.num_quarantined
            self._check(leaked == 0 and led.num_free + len(led._evictable) == led.usable_pages, "leak",
                        f"{node.name}: {leaked} pool pages still owned or quarantined")
            rows = link.staging.ledger
            self._check(rows.num_free == rows.usable_pages and not rows._fences, "leak",
                        f"{node.name}: transfer-buffer rows not all free ({rows.num_free}/{rows.usable_pages}, "
                        f"{rows.num_quarantined} fenced)")
            if node.role == "prefill":
                self._check(not link.held and not link.pending and not link._bypassed, "leak",
                            f"{node.name} still holds {list(link.held)} (passed over: {list(link._bypassed)[:5]})")
            else:
                self._check(not link.live and not link.waiting, "leak",
                            f"{node.name} still has pulls {list(link.live)}")
                self._check(not link._requests and not link._bypassed, "leak",
                            f"{node.name} still counts client requests in its queue: {list(link._requests)[:5]}, "
                            f"{list(link._bypassed)[:5]}")
                self.stats["decode_pull_records_never_settled"] += len(link.pulls)
        for node in self.nodes.values():
            for k, v in node.link.counters.items():
                self.stats[f"{node.role}_{k}"] += v
            if node.engine.prefix_cache is not None:
                self.stats[f"{node.role}_prefix_cache_hit_tokens"] += node.engine.prefix_cache.hits
        for k, v in self.transport.counters.items():
            self.stats[f"transport_{k}"] += v
        for node in self.nodes.values():
            fn = node.fnode
            self._check(fn.in_flight == 0, "router", f"the router still counts {fn.in_flight} in flight on {node.name}")
            self.stats[f"routed_{node.role}"] += fn.routed
        if len(self.nodes) > 2:
            self.stats["fleet_nodes"] += len(self.nodes)


@dataclass
class SimResult:
    seed: int
    lives: int
    steps: int
    seconds: float
    outcomes: Counter
    stats: Counter
    digest: str = ""      # of the whole step trace


def simulate(seed: int, lives: int = 1000, draw: bool = True, loaded=None, fleet: bool = False,
             scopes: bool = False, choices: bool = False, sched: bool = False, **overrides) -> SimResult:
    """Run one seed; raises SimFailure on the first invariant violation. `fleet`: draw a
    fleet, `scopes`: router processes and parties, `choices`: requests for n > 1 choices,
    `sched`: the engines' scheduling settings (SimConfig.draw); without `draw`, set them in
    overrides."""
    if not draw and (fleet or scopes or choices or sched):
        raise ValueError("fleet, scopes, choices and sched choose what SimConfig.draw draws: without draw, set "
                         "their fields in overrides")
    cfg = (SimConfig.draw(seed, lives, fleet=fleet, scopes=scopes, choices=choices, sched=sched, **overrides)
           if draw
           else SimConfig(seed=seed, lives=lives, **overrides))
    return Simulation(cfg, loaded).run()
