"""The control-plane credential as HTTP headers, for clients of the nodes' /internal/* routes
(the router, the canary harness, the benches). The messages are in kvfence/pd/messages.py;
the secret and what is derived from it in kvfence/pd/seal.py.
"""
from __future__ import annotations

from kvfence.pd.seal import control_headers, load_secret


def cluster_headers(secret: bytes | None = None) -> dict[str, str]:
    """The credential header; the secret from $KVFENCE_CLUSTER_SECRET(_FILE) unless given."""
    return control_headers(secret if secret is not None else load_secret())
