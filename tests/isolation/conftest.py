"""Helpers shared by the isolation tests: three tenants' prompts, stepping the engine to
the end (with a fault applied at a chosen step), the faults themselves, and the read audit.

The test modules import these with `from .conftest import ...` (this folder is a package
for that); the model fixtures come from tests/conftest.py, and `make_llm` here builds engines in
the default dtype, bfloat16 on the fused kernels: the invariants hold for what `kvfence serve`
runs, and a step takes ~11 ms here against float32's ~60 ms. Float32 keeps the parity tests.
"""
from __future__ import annotations

import pytest

from kvfence import SamplingParams
from kvfence.kv.audit import ReadAudit

BF16_PAGE = 16 * 30 * 2 * 3 * 64 * 2   # bytes of one 16-token KV page: 30 layers, K and V, 3 heads of 64, 2 B


@pytest.fixture(scope="session")
def make_llm(make_llm_bf16):
    """Engines in the default dtype, bfloat16 (tests/conftest.py)."""
    return make_llm_bf16

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The secret code of tenant A is", "Tenant B writes about the weather today:",
           "A recipe for bread starts with"]


def run_to_end(eng, before_step=None) -> None:
    """Step the engine until nothing is unfinished; before_step(i), if given, runs just
    before step i (counting from 0)."""
    step = 0
    while eng.has_unfinished():
        if before_step is not None:
            before_step(step)
        eng.step()
        step += 1


def run_three(llm, fault=None, at_step: int = 12):
    """Submit the three prompts as tenants A, B and C, apply fault(engine, seqs) (if given)
    before step `at_step`, run to the end; return the sequences."""
    eng = llm.engine
    seqs = [eng.add_request(llm.tokenizer.encode(p), GREEDY, tenant=t) for p, t in zip(PROMPTS, "ABC")]

    def before_step(step):
        if fault is not None and step == at_step:
            fault(eng, seqs)

    run_to_end(eng, before_step)
    return seqs


def point_at_neighbour(eng, seqs):
    """A's first page is replaced by one of B's live pages, with B's epoch: the worst case."""
    a, b = seqs[0], seqs[1]
    a.table.pages[0] = b.table.pages[0]
    a.table.epochs[0] = b.table.epochs[0]


def unwritten_slots(eng, seqs):
    """A claims 8 more computed tokens than were ever written (reserved-but-unwritten slots)."""
    a = seqs[0]
    eng.ledger.allocate(a.owner, 1, a.table)
    a.output_ids.extend([42] * 8)
    a.num_computed += 8


def claim_unwritten(eng, seqs):
    """A claims 32 more computed tokens than it wrote, on freshly granted pages (poisoned, or
    reused pages holding earlier requests' KV, depending on the scrub policy)."""
    a = seqs[0]
    need = eng.ledger.pages_for(a.num_computed + 40) - len(a.table)
    eng.ledger.allocate(a.owner, need, a.table)
    a.output_ids.extend([42] * 32)
    a.num_computed += 32


def audited(llm, **kw) -> ReadAudit:
    """Attach a fresh read audit (keyword arguments go to ReadAudit) to llm's runner."""
    audit = ReadAudit(llm.engine.ledger, **kw)
    llm.engine.runner.audit = audit
    return audit
