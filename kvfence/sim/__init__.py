"""Deterministic simulation of a PD cluster (kvfence/sim/cluster.py) and its campaign runner
(`python -m kvfence.sim`). Test and tooling code: no server path imports it."""
