"""The cluster capacity check (I8): the advertised context must fit every node on the path.

The router runs it on what the running nodes report (/internal/info), at start-up and
whenever a node (re)joins. It is the check whose absence caused the incident: a context
window advertised larger than the prefill node's KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.pd.messages import NodeInfo

# what prefill and decode must agree on for KV computed on one to mean anything on the other
MUST_MATCH = ("fingerprint", "page_size", "dtype")


@dataclass
class ClusterCheck:
    ok: bool                      # may the router serve?
    usable_context: int           # what it admits requests against
    advertised: int               # what the operator asked for (or the model's context)
    clamped: bool
    problems: list[str] = field(default_factory=list)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)   # role -> the facts checked

    @property
    def note(self) -> str:
        if not self.ok:
            return "; ".join(self.problems)
        if self.clamped:
            return (f"context clamped from {self.advertised} to {self.usable_context} tokens to fit every node "
                    f"(--clamp-context): " + "; ".join(self.problems))
        return f"context {self.usable_context} tokens fits every node"

    def to_json(self) -> dict:
        return {"ok": self.ok, "usable_context": self.usable_context, "advertised": self.advertised,
                "clamped": self.clamped, "problems": self.problems, "note": self.note,
                "nodes": {role: {"usable_context": f.usable_context, "pool_tokens": f.pool_tokens,
                                 "page_size": f.page_size, "dtype": f.dtype, "fingerprint": f.fingerprint,
                                 "model_max_context": f.model_max_context, "kv_layout": f.pd.kv_layout,
                                 "boot_id": f.pd.boot_id}
                          for role, f in self.nodes.items()}}


def check_cluster(advertised: int, nodes: dict[str, NodeInfo], clamp: bool) -> ClusterCheck:
    """nodes: role -> that node's facts. Mismatched model/layout is never clampable."""
    fatal: list[str] = []
    over: list[str] = []
    for key in MUST_MATCH:
        values = {role: getattr(f, key) for role, f in nodes.items()}
        if len(set(values.values())) > 1:
            fatal.append(f"nodes disagree on {key}: " + ", ".join(f"{r}={v}" for r, v in values.items()))
    layouts = {role: f.pd.kv_layout for role, f in nodes.items()}
    if len(set(layouts.values())) > 1:
        fatal.append("nodes disagree on the KV layout: " + ", ".join(f"{r}={v}" for r, v in layouts.items()))
    smallest = advertised
    for role, f in nodes.items():
        usable = f.usable_context
        if usable < advertised:
            over.append(f"advertised context {advertised} tokens exceeds the {role} node's usable capacity of "
                        f"{usable} tokens (KV pool {f.pool_tokens} tokens)")
        smallest = min(smallest, usable)
    if fatal or (over and not clamp):
        hint = [] if fatal else ["give the nodes more KV memory, lower --max-model-len, or pass --clamp-context"]
        return ClusterCheck(False, smallest, advertised, False, fatal + over + hint, dict(nodes))
    return ClusterCheck(True, smallest, advertised, bool(over), over, dict(nodes))
