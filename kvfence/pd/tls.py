"""TLS between the PD router and its nodes (I11), and the rule that makes it the default.

A PD process refuses to listen on an address other than loopback without TLS (a prefill or
decode node, without client certificates either), and the router refuses to reach a node
over plain HTTP anywhere but loopback, unless the operator passes --allow-plaintext-network
(the isolation statement then says so in its warnings).
Nodes serve uvicorn's TLS; with a CA file they also require a client certificate signed by
it (mTLS). The router verifies the nodes' certificates against its CA file and presents a
client certificate when given one.
"""
from __future__ import annotations

import ipaddress
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# every httpx client that carries the cluster credential or internal traffic (the router, drain,
# probe, the canary, the PD benches and the soak): HTTP_PROXY and
# ALL_PROXY are not followed, not even to a loopback node. The plaintext checks here look at
# the node's address only, and a proxy from the environment received the credential in the
# clear (found by a security probe)
FOLLOW_PROXY_ENV = False   # httpx trust_env


@dataclass(frozen=True)
class TlsSettings:
    cert: str | None = None          # this process's certificate (server side; PEM)
    key: str | None = None
    ca: str | None = None            # nodes: require client certs from this CA; router: verify nodes with it
    client_cert: str | None = None   # router: the certificate it presents to nodes (mTLS)
    client_key: str | None = None
    allow_plaintext: bool = False    # --allow-plaintext-network

    @property
    def serving(self) -> bool:
        return self.cert is not None

    def describe(self) -> dict[str, Any]:
        return {"tls": self.serving, "client_certificates_required": self.serving and self.ca is not None,
                "plaintext_network_allowed": self.allow_plaintext}


class PlaintextNetworkError(ValueError):
    """A PD process would send or accept internal traffic in the clear off loopback."""


def is_loopback(host: str) -> bool:
    """True for loopback addresses and names that resolve only to loopback."""
    return loopback_address(host) is not None


def loopback_address(host: str) -> str | None:
    """`host` as a loopback IP address, if it is one or is a name that resolves only to
    loopback; else None. A caller sending a secret connects to this address, not the name: a
    name resolved again could mean another host by then."""
    host = host.strip("[]")
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        pass
    try:
        addrs = sorted({str(ai[4][0]).split("%")[0] for ai in socket.getaddrinfo(host, None)})
    except OSError:
        return None
    return addrs[0] if addrs and all(ipaddress.ip_address(a).is_loopback for a in addrs) else None


def check_listen(role: str, host: str, tls: TlsSettings) -> None:
    if tls.allow_plaintext or is_loopback(host):
        return
    if tls.serving and role in ("prefill", "decode") and tls.ca is None:
        # its routes need the credential, but a connection takes one of --max-connections before
        # any request is read: without client certificates one host that reaches the port held
        # them all, and the routers got 503 (a security probe). With them, the TLS handshake
        # comes before the connection counts
        raise PlaintextNetworkError(
            f"the {role} node would take connections from any host that reaches {host}: pass --tls-ca FILE to "
            "require client certificates (the router's, from that CA), or listen on 127.0.0.1, or pass "
            "--allow-plaintext-network to accept an open network (a service mesh's mTLS, say)")
    if tls.serving:
        return
    raise PlaintextNetworkError(
        f"the {role} would serve its internal API in the clear on {host}, which is not loopback: give it a "
        "certificate (--tls-cert FILE --tls-key FILE, and --tls-ca FILE to require client certificates), or "
        "listen on 127.0.0.1, or pass --allow-plaintext-network to accept the risk")


def check_node_url(url: str, tls: TlsSettings) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"node URL {url!r} is not an http:// or https:// URL with a host "
                         "(e.g. http://127.0.0.1:8001)")
    if parts.scheme == "https" or tls.allow_plaintext or is_loopback(parts.hostname or ""):
        return
    raise PlaintextNetworkError(
        f"the router would reach the node {url} over plain HTTP off loopback: serve the nodes with TLS and use an "
        "https:// URL (with --tls-ca FILE to verify them), or pass --allow-plaintext-network to accept the risk")


def uvicorn_options(tls: TlsSettings, client_certificates: bool) -> dict[str, Any]:
    """uvicorn's TLS options. client_certificates: a node requires them when it has a CA; the
    router's public listener never does (tenants authenticate with API keys)."""
    if not tls.serving:
        return {}
    opts: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if client_certificates and tls.ca is not None:
        opts.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return opts


def client_context(tls: TlsSettings) -> ssl.SSLContext:
    """What the router's HTTP client verifies nodes with (and presents to them)."""
    ctx = ssl.create_default_context(cafile=tls.ca)
    if tls.client_cert is not None:
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
    return ctx
