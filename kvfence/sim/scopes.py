"""The simulation's router processes and parties (SimConfig.routers; docs/simulation.md):
routers that stamp requests and reload the tenants file in their own time, forget messages
nodes may miss, router restarts, and each node's ScopeGate with its queued retirements, some
of which fail. Checked: I9 by who sent what (one cache scope serves one party, ever).

A part of kvfence/sim/cluster.py's Simulation, kept here so that the scope model reads on its
own; its methods use the simulation's state (cfg, nodes, routers, party, srng, stats)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfence.pd.messages import ScopeStamp
from kvfence.pd.scope_epochs import ScopeRetired

if TYPE_CHECKING:
    from kvfence.sim.cluster import Life, Node


@dataclass
class SimRouter:
    """One router process as the nodes see it: its id, its reloads of the tenants file, and
    which party each name's keys belong to as it last read the file."""
    id: str
    parties: dict[str, int]                                  # tenant -> party, as this router read the file
    reloads: int = 0
    epochs: dict[str, int] = field(default_factory=dict)     # tenant -> its reload that last retired the name
    stale: set[str] = field(default_factory=set)             # names given to a new party since its last reload
    live: bool = True                                        # restarted: no new request comes through it


@dataclass
class Forget:
    """A router's forget message (POST /internal/forget_tenants) to one node process."""
    node: str
    boot: int
    router: str
    epoch: int
    tenants: tuple[str, ...]


class ScopeModel:
    """Simulation's actions and checks for router processes and parties."""

    def _admit_scope(self, life: Life, node: Node) -> str | None:
        """kvfence/pd/node.py's admission of a stamped request, on the same ScopeGate: a stale
        stamp is refused, a newer one queues the name's retirement first (the node missed the
        forget message), and a request queued behind a retirement that fails is refused before
        the engine admits it (as EngineLoop._admit does). The code it is refused with, or None."""
        if not life.router:
            return None
        queued = len(node.retirements)
        try:
            behind = node.scopes.admit(ScopeStamp(router=life.router, epoch=life.epoch), life.tenant)
        except ScopeRetired:
            rt = next(r for r in self.routers if r.id == life.router)
            self._check(rt.epochs.get(life.tenant, 0) > life.epoch, "I9",
                        f"{node.name} refused {life.rid} as stamped before a reload, but its router has not "
                        f"reloaded {life.tenant} since")
            life.excuses.add("rekey")
            self.stats["scope_stale_stamp_refused"] += 1
            self._log(f"  {node.name} refuses {life.rid}: stamped {life.epoch} by {life.router}, a retired scope")
            return "scope_retired"
        if len(node.retirements) > queued:   # its stamp is new here: its own retirement first
            self.stats["scope_retired_on_stamp"] += 1
        self._run_retirements(node)   # the submission is queued behind them: the engine runs them first
        if node.scopes.unretired(behind):
            life.excuses.add("retire_fail")
            self.stats["scope_refused_unretired"] += 1
            self._log(f"  {node.name} refuses {life.rid}: queued behind a failed retirement of its scope")
            return "engine_unavailable"
        return None

    def _run_retirements(self, node: Node) -> None:
        """The engine gets to the node's queued retirements (in order); a share of them raise."""
        queued, node.retirements = node.retirements, []
        for outcome, tenants, router in queued:
            if self.cfg.retire_fail and self.srng.random() < self.cfg.retire_fail:
                self.stats["scope_retire_failed"] += 1
                self._log(f"  {node.name}: retiring {','.join(tenants)}@{router} fails (injected)")
                outcome.set_exception(RuntimeError("injected: the retirement raised"))
                continue
            pages = sum(node.engine.forget_tenant(t, router) for t in tenants)
            self._log(f"  {node.name} retires {','.join(tenants)}@{router} ({pages} pages)")
            outcome.set_result(pages)

    def _check_party(self, life: Life, node: Node, seq) -> None:
        """I9 by who sent what, not by the engine's own scope ids: a cache scope (the pages a
        request may attach and publish to) serves one party, ever."""
        if not life.party:
            return
        key = (node.name, node.boot, seq.owner.cache_scope)
        first = self.scope_party.setdefault(key, life.party)
        self._check(first == life.party, "I9",
                    f"{node.name} put {life.rid} (party {life.party} via {life.router}, stamp {life.epoch}) in cache "
                    f"scope {seq.owner.cache_scope}, which served party {first}: another party's cached prompts "
                    f"are open to it")

    def _rekey(self) -> None:
        """The tenants file gives a name to another party (its keys replaced): every router
        serves the old party until it reloads."""
        tenant = self.srng.choice(sorted(self.party))
        self.party[tenant] += 1
        for rt in self.routers:
            if rt.live:
                rt.stale.add(tenant)
        self._log(f"tenants file: {tenant} is party {self.party[tenant]} now")

    def _router_reload(self) -> None:
        """One router reloads the file (kvfence/server/tenants.py registry_change): a new epoch
        for each name given to another party, and a forget message to each node it checked."""
        rt = self.srng.choice([r for r in self.routers if r.live and r.stale])
        rt.reloads += 1
        names = tuple(sorted(rt.stale))
        for t in names:
            rt.epochs[t] = rt.reloads
            rt.parties[t] = self.party[t]
        rt.stale.clear()
        sent = []
        for node in self.nodes.values():
            if node.up and self.srng.random() >= self.cfg.forget_drop:
                self.forgets.append(Forget(node.name, node.boot, rt.id, rt.reloads, names))
                sent.append(node.name)
        self._log(f"{rt.id} reloads ({rt.reloads}): {', '.join(names)} retired; forget to {', '.join(sent) or 'none'}")

    def _router_restart(self) -> None:
        """A router process is replaced: a new id, reading the file as it is now, with no
        epochs; the old one's requests in flight run on, nothing new comes through it."""
        old = self.srng.choice([r for r in self.routers if r.live])
        old.live = False
        new = SimRouter(f"router-{len(self.routers)}", dict(self.party))
        self.routers.append(new)
        self.stats["router_restarts"] += 1
        self._log(f"{old.id} replaced by {new.id}")

    def _deliver_forget(self) -> None:
        f = self.srng.choice(self.forgets)
        self.forgets.remove(f)
        node = self.nodes[f.node]
        if not node.up or node.boot != f.boot:
            self._log(f"forget {f.router}:{f.epoch} -> {f.node}: lost (node gone)")
            return
        queued = node.scopes.forget(f.router, f.epoch, list(f.tenants))
        node.poked = True
        self.stats["scope_forget_delivered"] += 1
        self._log(f"forget {f.router}:{f.epoch} {','.join(f.tenants)} -> {f.node}: "
                  f"{'retirement queued' if queued else 'nothing new here'}")
