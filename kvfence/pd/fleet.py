"""The router's view of its PD fleet: every node, its state, and where a request goes.

A node is `checking` until the router has heard from it, `ready` when its facts pass the
fleet's capacity check (kvfence/pd/capacity.py, I8), `refused` (with the reason) when they
do not, `down` when it stops answering, and `draining` when it said it is finishing its
requests before it exits. Only `ready` nodes get requests. The check runs on every answer,
so a node that restarts (new boot id) serves again only once its new facts passed it.

Routing:

- prefill: rendezvous hashing on (the tenant's cache scope, the prompt's leading pages),
  so requests of one scope with the same leading pages reach the same node and its prefix
  cache, bounded by load: a node already carrying more than LOAD_BOUND times its share of
  the requests in flight (plus LOAD_SLACK) is passed over for the next in that request's order. The scope
  comes from the authenticated tenant (server/app.py), never from a request field.
- decode: the node with the fewest requests routed to it in flight, then the most free pool
  pages (from its last report).

Why this keeps I9 (no cross-tenant prefix-cache signal) across the fleet: a request's node
order depends only on its own scope and tokens; other tenants can move it down that order
only through load, which they can observe as load whatever the routing. The prefix cache on
each node is scoped by tenant (kv/prefix_cache.py), so landing on a node where another
tenant's identical prefix is cached gives no hit and no timing difference from a miss.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass

from kvfence import incidents
from kvfence.pd.addresses import NodeAddress
from kvfence.pd.capacity import node_problems
from kvfence.pd.messages import NodeInfo
from kvfence.pd.settings import ROLES

log = logging.getLogger("kvfence.pd.fleet")

STATES = ("checking", "ready", "refused", "down", "draining")
PREFILL_ROUTING = ("affinity", "round-robin")   # round-robin: for comparison (kvfence bench --fleet)
LOAD_BOUND = 1.25          # bounded-load hashing: at most this times the average in flight per node ...
LOAD_SLACK = 2             # ... plus this many: a hit on the home node's cache is cheap, a miss elsewhere is not
                           # (measured: without it, 4 in flight over 2 nodes sent hits away and lost to round robin)
AFFINITY_PAGES = 4         # leading full pages of the prompt that pick the prefill node


@dataclass
class Node:
    role: str
    url: str                     # where the router connects (an address, when the configured URL is a name)
    address: NodeAddress | None = None
    state: str = "checking"
    reason: str = ""
    info: NodeInfo | None = None
    # the boot whose facts last passed the capacity check (I8): what requests name as
    # expect_boot. Not info's boot: the monitor (its own thread) sets info before it checks it,
    # and a request in between would have named a new, unchecked boot (found in review)
    checked_boot: str | None = None
    in_flight: int = 0           # requests the router has on it now
    routed: int = 0              # requests the router ever sent it
    since: float = 0.0           # when it entered its state (time.time())

    @property
    def boot_id(self) -> str | None:
        return self.info.pd.boot_id if self.info is not None else None

    def to_json(self) -> dict:
        snap = self.info.snapshot if self.info is not None else {}
        a = self.address
        return {"role": self.role, "url": self.url, "configured_url": a.configured if a else self.url,
                "host": (a.host or None) if a else None, "state": self.state, "reason": self.reason or None,
                "boot_id": self.boot_id, "usable_context": self.info.usable_context if self.info else None,
                "pool_pages_free": snap.get("pages_free"), "pool_pages_total": snap.get("pages_total"),
                "running": snap.get("running"), "waiting": snap.get("waiting"),
                "in_flight": self.in_flight, "routed": self.routed, "since": self.since,
                "secret_key_ids": list(self.info.secret_key_ids) if self.info else []}

    @property
    def seals_with(self) -> str | None:
        """The key id of the cluster secret this prefill node seals with (None: a node from
        before key ids, or not known yet)."""
        return self.info.secret_key_ids[0] if self.info is not None and self.info.secret_key_ids else None

    def accepts(self, key: str | None) -> bool:
        """Whether this decode node opens rows sealed under `key` (a node from before key ids,
        or an unknown key: taken as yes, as before)."""
        return key is None or self.info is None or not self.info.secret_key_ids or key in self.info.secret_key_ids


class Fleet:
    def __init__(self, urls: dict[str, list[str]] | dict[str, list[NodeAddress]], usable_context: int,
                 reference: NodeInfo, prefill_routing: str = "affinity"):
        if prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill routing must be one of {', '.join(PREFILL_ROUTING)}")
        self.usable_context = usable_context       # fixed while serving
        self.reference = reference                 # the model and KV layout every node must match
        self.nodes: list[Node] = []
        for role, items in urls.items():
            for item in items:
                a = item if isinstance(item, NodeAddress) else NodeAddress(item, item)
                self.nodes.append(Node(role, a.url, a, since=time.time()))
        self.prefill_routing = prefill_routing
        self._turn = 0
        # since the router started: how often nodes of each role entered each state, and came
        # back with a new boot (a restart). The state gauge alone missed a node down for a few
        # seconds between two scrapes (found by a fleet probe)
        self.entered: dict[tuple[str, str], int] = {(role, st): 0 for role in ROLES for st in STATES}
        self.restarts: dict[str, int] = dict.fromkeys(ROLES, 0)
        self._counting = threading.Lock()   # the monitor's thread and the request loop both move nodes
        self._unsealable: dict[str, str | None] = {}   # prefill url -> the key id logged as accepted by none

    def by_url(self, url: str) -> Node | None:
        return next((n for n in self.nodes if n.url == url), None)

    def sync(self, role: str, configured: str, addresses: list[NodeAddress]) -> tuple[list[Node], list[Node]]:
        """The addresses a configured URL resolves to now: nodes for new ones (checking until
        the monitor's next answer passes), and out with those it no longer names. Returns
        (added, removed). A removed node's requests finish; nothing new goes to it."""
        have = {n.url: n for n in self.nodes if n.role == role and n.address is not None
                and n.address.configured == configured}
        urls = {a.url for a in addresses}
        elsewhere = {n.url for n in self.nodes if n.url not in have}   # listed under another URL already
        added = [Node(role, a.url, a, since=time.time()) for a in addresses
                 if a.url not in have and a.url not in elsewhere]
        removed = [n for url, n in have.items() if url not in urls]
        for n in added:
            log.info("%s node %s (%s) appeared: checking it", role, n.url, configured)
        for n in removed:
            log.warning("%s node %s no longer in %s: out of the fleet", role, n.url, configured)
        self.nodes = [n for n in self.nodes if n not in removed] + added
        for n in removed:
            self._unsealable.pop(n.url, None)
        return added, removed

    def serving(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role and n.state == "ready"]

    @property
    def ready(self) -> bool:
        return bool(self.sealable(self.serving("prefill"))) and bool(self.serving("decode"))

    def counts(self) -> dict[str, dict[str, int]]:
        """role -> state -> nodes, every state listed (for the metrics)."""
        return {role: {s: sum(1 for n in self.nodes if n.role == role and n.state == s) for s in STATES}
                for role in ROLES}

    def changes(self) -> dict[str, dict[str, int]]:
        """role -> {state: times a node entered it, "restarts": new boots seen} (for the metrics)."""
        return {role: {**{st: self.entered[role, st] for st in STATES}, "restarts": self.restarts[role]}
                for role in ROLES}

    # -- what the monitor saw -------------------------------------------------------------------
    def observe(self, node: Node, info: NodeInfo | None, error: str | None = None) -> None:
        """A node's answer to /internal/info (info), or why there was none (error)."""
        if info is None:
            self._move(node, "down", error or "no answer")
            return
        new_boot = info.pd.boot_id != node.boot_id
        if new_boot and node.boot_id is not None:
            with self._counting:
                self.restarts[node.role] += 1
        node.info = info
        if info.snapshot.get("draining"):
            self._move(node, "draining", "the node is draining")
            return
        problems = node_problems(self.usable_context, self.reference, info, node.role)
        if problems:
            self._move(node, "refused", "; ".join(problems), loud=new_boot)
        else:
            node.checked_boot = info.pd.boot_id
            self._move(node, "ready", "", rejoined=new_boot)

    def recheck(self, node: Node, reason: str) -> None:
        """The node refused a request as not ready (it restarted since its last check, or is
        starting): no request goes to it until the monitor's next answer from it passes."""
        if node.state == "ready":
            self._move(node, "checking", reason)

    def _move(self, node: Node, state: str, reason: str, loud: bool = False, rejoined: bool = False) -> None:
        if state == node.state and reason == node.reason and not loud and not rejoined:
            return
        before = node.state
        node.state, node.reason, node.since = state, reason, time.time()
        if state != before:
            with self._counting:
                self.entered[node.role, state] += 1
        if state == "ready":
            log.info("%s node %s is ready (boot %s, passed the capacity check, I8)%s", node.role, node.url,
                     node.boot_id, " after a restart" if rejoined and before != "checking" else "")
        elif state == "refused":
            log.error("%s node %s is refused and gets no request: %s", node.role, node.url, reason)
            incidents.record("node_refused", detail=f"{node.role} node {node.url} (boot {node.boot_id}): {reason}")
        else:
            log.warning("%s node %s is %s: %s", node.role, node.url, state, reason)

    # -- routing ----------------------------------------------------------------------------------
    def sealable(self, nodes: list[Node]) -> list[Node]:
        """The prefill nodes whose rows some ready decode node can open: mid-rotation, a prefill
        node sealing with a secret no decode node accepts yet would have every handoff refused
        (an operator's walkthrough: 50 failed requests in 25 s while both nodes showed ready)."""
        decodes = self.serving("decode")
        if not decodes:   # no decode node at all is another fault, said as such (not a key's)
            return nodes
        ok = [n for n in nodes if any(d.accepts(n.seals_with) for d in decodes)]
        for n in nodes:
            if n not in ok and self._unsealable.get(n.url) != n.seals_with:
                self._unsealable[n.url] = n.seals_with
                log.error("prefill node %s seals with cluster secret key id %s, which no ready decode node accepts: "
                          "it gets no request until one does (give every decode node that secret with "
                          "--accept-cluster-secret-file first; docs/pd.md, rotating)", n.url, n.seals_with)
            elif n in ok:
                self._unsealable.pop(n.url, None)
        return ok

    def pick_prefill(self, scope: str, prompt_ids: list[int], page_size: int,
                     exclude: frozenset[str] = frozenset()) -> Node | None:
        nodes = self.sealable([n for n in self.serving("prefill") if n.url not in exclude])
        if not nodes:
            return None
        if self.prefill_routing == "round-robin":
            self._turn += 1
            return nodes[self._turn % len(nodes)]
        key = affinity_key(scope, prompt_ids, page_size)
        order = sorted(nodes, key=lambda n: _score(key, n.url), reverse=True)
        bound = math.ceil(LOAD_BOUND * (sum(n.in_flight for n in nodes) + 1) / len(nodes)) + LOAD_SLACK
        return next((n for n in order if n.in_flight < bound), order[0])

    def pick_decode(self, exclude: frozenset[str] = frozenset(), seal_key: str | None = None) -> Node | None:
        """The least loaded ready decode node that opens rows sealed under `seal_key`."""
        nodes = [n for n in self.serving("decode") if n.url not in exclude and n.accepts(seal_key)]
        if not nodes:
            return None
        return min(nodes, key=lambda n: (n.in_flight, -(n.info.snapshot.get("pages_free", 0) if n.info else 0),
                                         n.url))

    def to_json(self) -> list[dict]:
        return [n.to_json() for n in self.nodes]


def affinity_key(scope: str, prompt_ids: list[int], page_size: int) -> bytes:
    """The cache scope and the prompt's first AFFINITY_PAGES full pages (all of the full
    pages of a shorter prompt): what decides which prefill node's cache a prompt can hit."""
    full = min(AFFINITY_PAGES, max(0, len(prompt_ids) - 1) // page_size) * page_size
    h = hashlib.sha256(scope.encode("utf-8", "surrogatepass") + b"\0")
    h.update(b",".join(str(t).encode() for t in prompt_ids[:full]))
    return h.digest()


def _score(key: bytes, url: str) -> bytes:
    return hashlib.sha256(key + url.encode()).digest()
