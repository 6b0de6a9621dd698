"""Node URLs as the addresses behind them.

A configured node URL whose host is a name (a Kubernetes headless Service, a DNS round
robin) means every address the name resolves to: one fleet node per address, found again
while the router runs, so pods that appear are checked and served without a restart and
pods that go away leave the fleet. The router connects to the address and, over TLS,
presents the name as SNI and verifies the node's certificate against the name, as it
would had it connected by name. A URL whose host is an IP address is one node, as given.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

# (host, port) -> the addresses it resolves to; socket.getaddrinfo's in the router,
# a table in unit tests
Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class NodeAddress:
    url: str          # what the router connects to: the configured URL, its host replaced by one address
    configured: str   # the URL as the operator gave it
    host: str = ""    # the configured host name (TLS server name, certificate check); "" for an IP URL

    def http_options(self, **kw) -> dict:
        """httpx request options (`kw` merged in) that make a connection to `url` speak to
        `host`: its name in the Host header and, over TLS, as the server name."""
        if not self.host:
            return kw
        headers = {**kw.pop("headers", {}), "host": urlsplit(self.configured).netloc}
        if self.url.startswith("https://"):
            kw["extensions"] = {"sni_hostname": self.host}
        return {**kw, "headers": headers}


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def expand(url: str, resolve: Resolver = system_resolver) -> list[NodeAddress] | None:
    """Every address behind `url`, in a stable order; None when its name does not resolve
    now (the caller keeps what it had and tries again later)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not host or _is_ip(host):
        return [NodeAddress(url, url)]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = resolve(host, port)
    except OSError:
        return None
    out: list[NodeAddress] = []
    for addr in sorted(set(found), key=lambda a: (":" in a, a)):
        shown = f"[{addr}]" if ":" in addr else addr
        netloc = f"{shown}:{port}"
        out.append(NodeAddress(urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/"), url, host))
    return out
