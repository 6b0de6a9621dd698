"""The messages between the router and the PD nodes: JSON bodies and NDJSON streams.

One place for their shape, so router and nodes cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import json
import os

from kvfence.engine.params import SamplingParams

CLUSTER_TOKEN_ENV = "KVFENCE_CLUSTER_TOKEN"
CLUSTER_TOKEN_HEADER = "x-kvfence-cluster-token"


def params_to_json(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_json(d: dict) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
    return SamplingParams(**d)


def line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def cluster_token() -> str | None:
    """An optional shared secret on the internal API (the nodes' /internal/* routes)."""
    return os.environ.get(CLUSTER_TOKEN_ENV) or None


def cluster_headers() -> dict:
    tok = cluster_token()
    return {CLUSTER_TOKEN_HEADER: tok} if tok else {}
