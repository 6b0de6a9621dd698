"""The capacity check (I8) across a PD fleet: the advertised context must fit every node a
request can be routed to, and every node must run the same model with the same KV layout.

The router decides the advertised context once, at start (`plan_fleet`: `--max-model-len`,
or the smallest usable context among the nodes it can check then; `--clamp-context` lowers
it to fit them, and says so). From then on it never changes while serving. Every node is
checked against it when it joins and whenever it rejoins with a new boot id
(`node_problems`); a node that does not pass is refused and gets no request. This is the
check whose absence caused the incident: a context window advertised larger than the
prefill nodes' KV pool.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvfence.pd.messages import NodeInfo

# what every node must agree on for KV computed on one to mean anything on another (weights:
# KV that bf16 weights computed, continued by native int8 arithmetic, is neither one's answer)
MUST_MATCH = ("fingerprint", "page_size", "dtype", "weights")


def node_problems(advertised: int, reference: NodeInfo, node: NodeInfo, role: str, where: str = "") -> list[str]:
    """Why `node` may not serve in a fleet advertising `advertised` tokens whose model facts
    are `reference`'s; empty when it may. `where` names the node in the messages."""
    name = f"the {role} node"
    problems = []
    if node.pd.role != role:
        problems.append(f"{name} is a {node.pd.role} node")
    for key in MUST_MATCH:
        mine, fleet = getattr(node, key), getattr(reference, key)
        if mine != fleet:
            problems.append(f"{name} has {key} {mine}, the fleet {fleet}")
    if node.pd.kv_layout != reference.pd.kv_layout:
        problems.append(f"{name} has KV layout {node.pd.kv_layout}, the fleet {reference.pd.kv_layout}")
    if node.usable_context < advertised:
        problems.append(f"advertised context {advertised} tokens exceeds {name}'s usable capacity of "
                        f"{node.usable_context} tokens (KV pool {node.pool_tokens} tokens)")
    return [f"{p} [{where}]" for p in problems] if where else problems


@dataclass
class ClusterCheck:
    ok: bool                      # may the router serve (a ready node of each role)?
    usable_context: int           # what it admits requests against, fixed while it serves
    advertised: int               # what the operator asked for (or the nodes' smallest context)
    clamped: bool
    problems: list[str] = field(default_factory=list)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)   # url -> the facts checked at start
    roles: dict[str, str] = field(default_factory=dict)        # url -> role
    refused: dict[str, list[str]] = field(default_factory=dict)   # url -> why, at start
    reference: NodeInfo | None = None   # the model and KV layout every node must match

    @property
    def note(self) -> str:
        if not self.ok:
            return "; ".join(self.problems)
        text = f"context {self.usable_context} tokens fits every serving node"
        if self.clamped:
            text = (f"context clamped from {self.advertised} to {self.usable_context} tokens to fit every node "
                    f"(--clamp-context)")
        if self.refused:   # which nodes and why name their URLs: the log and the cluster route (scrape key)
            text += f"; {len(self.refused)} node(s) refused (which and why: the router's log and /v1/kvfence/cluster)"
        return text

    def to_json(self) -> dict:
        return {"ok": self.ok, "usable_context": self.usable_context, "advertised": self.advertised,
                "clamped": self.clamped, "problems": self.problems, "note": self.note,
                "nodes": {url: {"role": self.roles.get(url), "usable_context": f.usable_context,
                                "pool_tokens": f.pool_tokens, "page_size": f.page_size, "dtype": f.dtype,
                                "fingerprint": f.fingerprint, "model_max_context": f.model_max_context,
                                "kv_layout": f.pd.kv_layout, "boot_id": f.pd.boot_id,
                                "refused": self.refused.get(url, [])}
                          for url, f in self.nodes.items()}}


def _model_of(f: NodeInfo) -> tuple:
    return (*(getattr(f, k) for k in MUST_MATCH), f.pd.kv_layout)


def plan_fleet(requested: int | None, nodes: dict[str, tuple[str, NodeInfo]], clamp: bool) -> ClusterCheck:
    """The start-up check. nodes: url -> (role, facts) of every node that answered. The
    reference model is the one most nodes run (ties: the first prefill node's, by URL), so
    one misconfigured node is refused instead of refusing the rest; mismatched nodes are
    never clampable. ok: at least one node of each role passes."""
    prefill = sorted(u for u, (r, _) in nodes.items() if r == "prefill")
    ordered = prefill + sorted(u for u in nodes if u not in prefill)
    if not ordered:
        return ClusterCheck(False, requested or 0, requested or 0, False, ["no node answered"])
    votes = Counter(_model_of(nodes[u][1]) for u in ordered)
    best = max(votes.values())
    reference = next(nodes[u][1] for u in ordered if votes[_model_of(nodes[u][1])] == best)
    matching = [u for u in ordered if not node_problems(0, reference, nodes[u][1], nodes[u][0])]
    smallest = min((nodes[u][1].usable_context for u in matching), default=0)
    advertised = requested or smallest
    usable = min(advertised, smallest) if clamp else advertised
    refused = {u: ps for u in ordered if (ps := node_problems(usable, reference, nodes[u][1], nodes[u][0], u))}
    serving = {nodes[u][0] for u in ordered if u not in refused}
    problems = [p for ps in refused.values() for p in ps]
    ok = serving >= {"prefill", "decode"}
    if not ok:
        missing = sorted({"prefill", "decode"} - serving)
        problems.append(f"no {' and no '.join(missing)} node passes the check: give the nodes more KV memory, "
                        f"lower --max-model-len, or pass --clamp-context")
    return ClusterCheck(ok, usable, advertised, usable < advertised, problems,
                        {u: f for u, (_, f) in nodes.items()}, {u: r for u, (r, _) in nodes.items()}, refused,
                        reference)
