"""The cluster credential on the internal API (the nodes' /internal/* routes).

The messages themselves are defined in kvfence/pd/messages.py.
"""
from __future__ import annotations

import os

CLUSTER_TOKEN_ENV = "KVFENCE_CLUSTER_TOKEN"
CLUSTER_TOKEN_HEADER = "x-kvfence-cluster-token"


def cluster_token() -> str | None:
    """An optional shared secret on the internal API."""
    return os.environ.get(CLUSTER_TOKEN_ENV) or None


def cluster_headers() -> dict:
    tok = cluster_token()
    return {CLUSTER_TOKEN_HEADER: tok} if tok else {}
