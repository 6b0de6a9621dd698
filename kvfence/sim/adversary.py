"""A network adversary inside the PD simulation (I10, I11).

A party on the PD network without the cluster secret. At random steps it reads a node's
registered transfer buffer, overwrites a row with bytes of its own, copies one request's
sealed row over another's (a splice, or a replay of an old row), or sends a node an
internal message under a credential it made up. After each action the simulation's
invariants run as after any other step; what this adds:

- I10 on reads: a row granted to a hold or pull never shows its request's KV in the clear
  (the content oracle's plaintext), and a free row holds only zeros (unless the node came
  back on its old, un-zeroed memory after a crash, which the simulation also models);
- its writes and splices only ever make the affected request fail (kv_verification_failed
  is what explains it); the content oracle still catches any 200 over foreign bytes;
- I11: a forged message is refused by the node's credential check (the same function the
  nodes' internal routes use) and changes nothing.
"""
from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import torch

from kvfence.kv.ledger import PageState

if TYPE_CHECKING:
    from kvfence.sim.cluster import Life, Node, Simulation

OWNED = int(PageState.OWNED)
FREE = int(PageState.FREE)


class NetworkAdversary:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.rng = sim.rng
        # rows it wrote: (role, boot, row) -> the row's epoch then. A free row it wrote holds
        # its own bytes until kvfence grants and frees (zeroes) it again, a new epoch.
        self.dirty: dict[tuple[str, int, int], int] = {}

    def act(self) -> None:
        up = [n for n in self.sim.nodes.values() if n.up]
        if not up:
            return
        node = self.rng.choice(up)
        kind = self.rng.choices(["read", "write", "splice", "forge", "replay"], [3, 2, 1, 1, 1])[0]
        self.sim.stats[f"adversary_{kind}"] += 1
        getattr(self, kind)(node)

    # -- what a peer reaching the transfer ports can do ----------------------------------------
    def _no_plaintext(self, node: Node, life: Life, rows: list[int]) -> None:
        st = node.link.staging
        for i, row in enumerate(rows):
            self.sim._check(not torch.equal(st.buf[row, :st.data_bytes], life.truth[i]), "I10",
                            f"{node.name}'s registered row {row} holds {life.rid}'s page {i} in the clear")

    def read(self, node: Node) -> None:
        """Everything it can reach: both nodes' registered buffers."""
        for n in self.sim.nodes.values():
            if n.up:
                self._read(n)

    def _read(self, node: Node) -> None:
        st = node.link.staging
        led, buf = st.ledger, st.buf
        if node.role == "prefill":   # rows held for a pull
            for life in self.sim.lives.values():
                m = life.held
                if m is None or life.truth is None or m["boot_id"] != node.link.boot_id:
                    continue
                held = [r for r in m["slots"] if led.state[r] == OWNED and int(led.owner_request[r]) == life.p_owner]
                if len(held) == len(m["slots"]):
                    self._no_plaintext(node, life, held)
        else:                        # rows a pull wrote (or is writing) into
            for p in node.link.pulls.values():
                life = self.sim.lives.get(p.seq.request_id)
                if life is not None and life.truth is not None and node.link.live.get(life.rid) == p.pull_id:
                    self._no_plaintext(node, life, list(p.rows.pages))
        if not node.reused_memory:
            free = [int(r) for r in (led.state == FREE).nonzero()[0] if r != 0
                    and self.dirty.get((node.name, node.boot, int(r))) != int(led.epoch[r])]
            if free:
                bad = [r for r in free if buf[r].any()]
                self.sim._check(not bad, "I10", f"free rows {bad} of {node.name}'s transfer buffer are not zeroed")
        self.sim._log(f"ADVERSARY reads {node.name}'s transfer buffer")

    def _victim(self, node: Node, row: int) -> Life | None:
        led = node.link.staging.ledger
        if led.state[row] == FREE:
            return None
        owner = int(led.owner_request[row])
        for life in self.sim.open:
            if owner == (life.p_owner if node.role == "prefill" else life.d_owner):
                return life
        return None

    def _mark(self, node: Node, row: int) -> None:
        self.dirty[(node.name, node.boot, row)] = int(node.link.staging.ledger.epoch[row])
        life = self._victim(node, row)
        if life is not None:
            life.excuses.add("adversary")

    def write(self, node: Node) -> None:
        st = node.link.staging
        row = self.rng.randrange(1, st.buf.shape[0])
        start = self.rng.randrange(0, st.slot_bytes)
        n = min(self.rng.randrange(1, 64), st.slot_bytes - start)
        noise = bytes(self.rng.getrandbits(8) for _ in range(n))
        before = st.buf[row, start:start + n].clone()
        st.buf[row, start:start + n] = torch.frombuffer(bytearray(noise), dtype=torch.uint8)
        if torch.equal(before, st.buf[row, start:start + n]):
            st.buf[row, start] ^= 0x01   # never a no-op write
        self._mark(node, row)
        self.sim._log(f"ADVERSARY writes {n} bytes into {node.name}'s row {row}")

    def splice(self, node: Node) -> None:
        st = node.link.staging
        rows = st.buf.shape[0]
        src, dst = self.rng.randrange(1, rows), self.rng.randrange(1, rows)
        if src == dst or torch.equal(st.buf[src], st.buf[dst]):
            return
        st.buf[dst] = st.buf[src]
        self._mark(node, dst)
        self.sim._log(f"ADVERSARY copies {node.name}'s row {src} over row {dst}")

    def replay(self, node: Node) -> None:
        """An internal message delivered once already, delivered again (the credential is
        the real one: the worst case, a replay inside a channel): request ids are unique and
        every handler is idempotent, so it changes nothing the invariants would notice."""
        if not self.sim.delivered:
            return
        m = self.rng.choice(self.sim.delivered)
        self.sim.msgs.append(m)
        self.sim._log(f"ADVERSARY replays {m.kind} {m.rid} -> {m.node}")

    def forge(self, node: Node) -> None:
        """An internal call under a made-up credential: the node's check refuses it."""
        presented = secrets.token_hex(32)
        accepted = self.sim.settings.secrets.accepts(presented)
        self.sim._check(not accepted, "I11", "a node accepted an internal call under a forged credential")
        self.sim.stats["adversary_forged_refused"] += 1
        self.sim._log(f"ADVERSARY forges an internal call to {node.name}: refused")
