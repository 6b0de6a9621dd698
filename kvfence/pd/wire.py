"""The control-plane credential as HTTP headers, for clients of the nodes' /internal/* routes
(the router, the canary harness, the benches). The messages are in kvfence/pd/messages.py;
the secret and what is derived from it in kvfence/pd/seal.py.
"""
from __future__ import annotations

from collections.abc import Generator

import httpx

from kvfence.pd.seal import CONTROL_HEADER, Keyring, control_headers, control_token, load_secret


def cluster_headers(secret: bytes | None = None) -> dict[str, str]:
    """The credential header; the secret from $KVFENCE_CLUSTER_SECRET(_FILE) unless given."""
    return control_headers(secret if secret is not None else load_secret())


class ClusterAuth(httpx.Auth):
    """Puts on each request the credential of the secret the keyring sends with at that moment,
    so a long-lived client (the router's) follows a reload of the secret files (SIGHUP)."""

    def __init__(self, keyring: Keyring):
        self.keyring = keyring

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[CONTROL_HEADER] = control_token(self.keyring.current.own)
        yield request
