"""Multi-host PD: prefill and decode on two separate network hosts (Linux network namespaces)
joined by a veth pair, the router outside them, in the root namespace.

    root ns (router, test) --veth-- ns P (prefill) --veth-- ns D (decode) --veth-- root ns
                 10.231.B.5/.6 (HTTP)   10.231.B.1 === 10.231.B.2 (KV)   10.231.B.10/.9 (HTTP)

Each node listens on 0.0.0.0 inside its namespace; the router reaches it over its own
root<->node link; the transfer engines advertise the P<->D link's addresses, the only
route between the two namespaces, so decode's pulls must cross that veth. The proof is
not a packet capture but the counters: prefill's transfer session is its P<->D address,
decode reports the bytes it pulled, and the veth's own receive counter on decode's end
grew by at least that much.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from certs import make_pki
from pd_cluster import Cluster
from test_cluster import LONG, model_name, single_node_text

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _free_subnet() -> int:
    """A third octet B such that no 10.231.B.x address or route is in use in the root namespace."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    for _ in range(100):
        b = random.randrange(256)
        if f"10.231.{b}." not in used:
            return b
    raise RuntimeError("no free 10.231.B.0/28 subnet in the root namespace")


def _rx_bytes(ns: str, dev: str) -> int:
    stats = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", dev).stdout)
    return int(stats[0]["stats64"]["rx"]["bytes"])


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces (prefill, decode) with the links drawn above; always torn down."""
    if os.geteuid() != 0:
        pytest.skip("multi-host PD test: creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("multi-host PD test: no `ip` command (Debian package iproute2)")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(256):02x}"
    ns = {"prefill": f"kvf{tag}p", "decode": f"kvf{tag}d"}
    # interface names: at most 15 characters; one pair P<->D, one pair root<->each node
    pd_link = {"prefill": f"kvf{tag}pd", "decode": f"kvf{tag}dp"}
    root_end = {"prefill": f"kvf{tag}rp", "decode": f"kvf{tag}rd"}
    node_end = {"prefill": f"kvf{tag}pr", "decode": f"kvf{tag}dr"}
    created: list[str] = []
    try:
        r = _ip("netns", "add", ns["prefill"], check=False)
        if r.returncode != 0:
            pytest.skip(f"multi-host PD test: cannot create a network namespace here: {r.stderr.strip()}")
        created.append(ns["prefill"])
        _ip("netns", "add", ns["decode"])
        created.append(ns["decode"])
        b = _free_subnet()
        net = f"10.231.{b}"
        kv_addr = {"prefill": f"{net}.1", "decode": f"{net}.2"}
        http_addr = {"prefill": f"{net}.6", "decode": f"{net}.10"}
        root_addr = {"prefill": f"{net}.5", "decode": f"{net}.9"}
        for role in ("prefill", "decode"):
            _ip("-n", ns[role], "link", "set", "lo", "up")
        _ip("link", "add", pd_link["prefill"], "netns", ns["prefill"], "type", "veth",
            "peer", "name", pd_link["decode"], "netns", ns["decode"])
        for role in ("prefill", "decode"):
            _ip("-n", ns[role], "addr", "add", f"{kv_addr[role]}/30", "dev", pd_link[role])
            _ip("-n", ns[role], "link", "set", pd_link[role], "up")
            _ip("link", "add", root_end[role], "type", "veth", "peer", "name", node_end[role], "netns", ns[role])
            _ip("addr", "add", f"{root_addr[role]}/30", "dev", root_end[role])
            _ip("link", "set", root_end[role], "up")
            _ip("-n", ns[role], "addr", "add", f"{http_addr[role]}/30", "dev", node_end[role])
            _ip("-n", ns[role], "link", "set", node_end[role], "up")
        yield {"ns": ns, "kv_addr": kv_addr, "http_addr": http_addr, "pd_link": pd_link}
    finally:
        for role in ("prefill", "decode"):
            _ip("link", "del", root_end[role], check=False)  # deletes both ends of the pair
        for name in created:
            _ip("netns", "del", name, check=False)


@pytest.fixture(scope="module")
def pki(hosts, tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), [hosts["http_addr"][r] for r in ("prefill", "decode")])


@pytest.fixture(scope="module")
def cluster(hosts, pki, tmp_path_factory):
    """Off loopback the nodes must serve TLS (they refuse to start otherwise): each serves
    HTTPS and requires the router's client certificate (mTLS)."""
    ns = hosts["ns"]
    c = Cluster(tmp_path_factory.mktemp("pd-netns"),
                hosts={role: hosts["http_addr"][role] for role in ("prefill", "decode")},
                binds={"prefill": "0.0.0.0", "decode": "0.0.0.0"},
                transfer_hosts=hosts["kv_addr"],
                prefixes={role: ["ip", "netns", "exec", ns[role]] for role in ("prefill", "decode")}, pki=pki)
    try:
        yield c.start_all()
    finally:
        c.stop()


def test_decode_reaches_prefill_only_over_the_veth(hosts):
    """The set-up itself: from decode's namespace, prefill's KV address routes over the P<->D link."""
    route = _ip("-n", hosts["ns"]["decode"], "route", "get", hosts["kv_addr"]["prefill"]).stdout
    assert f"dev {hosts['pd_link']['decode']}" in route, route


def test_pd_output_equals_single_node_across_hosts(hosts, cluster, make_llm):
    client = openai.OpenAI(base_url=cluster.url("router") + "/v1", api_key="none", max_retries=0, timeout=120)
    pre = cluster.info("prefill")["pd"]
    assert pre["transfer_session"].startswith(hosts["kv_addr"]["prefill"] + ":"), pre["transfer_session"]
    assert cluster.info("decode")["pd"]["transfer_session"].startswith(hosts["kv_addr"]["decode"] + ":")
    nodes = httpx.get(cluster.url("router") + "/v1/kvfence/cluster", timeout=10).json()
    assert nodes["ready"] and sorted(n["role"] for n in nodes["nodes"]) == ["decode", "prefill"]
    assert all(n["state"] == "ready" for n in nodes["nodes"]), nodes

    ns, link = hosts["ns"]["decode"], hosts["pd_link"]["decode"]
    rx_before, bytes_before = _rx_bytes(ns, link), cluster.pd("decode")["transferred_bytes"]
    m = model_name(client)
    prompts = ["The capital of France is", "Write a haiku about the sea.\n", LONG]  # LONG: 300+ tokens, 20+ pages
    for p in prompts:
        r = client.completions.create(model=m, prompt=p, max_tokens=16, temperature=0)
        assert r.choices[0].text == single_node_text(make_llm, p, 16), p[:40]
    dec = cluster.pd("decode")
    assert dec["pd_verified"] >= 3
    pulled = dec["transferred_bytes"] - bytes_before
    assert pulled > 20 * 700_000  # the long prompt's pages crossed over ...
    crossed = _rx_bytes(ns, link) - rx_before
    assert crossed >= pulled, (crossed, pulled)  # ... over the P<->D veth, into decode's namespace
    cluster.wait_quiet()


def test_nodes_off_loopback_speak_only_tls_with_the_routers_certificate(hosts, cluster, pki):
    """The internal API across hosts: plain HTTP is not served, a client without a
    certificate or with one from another CA is refused in the handshake, and even with the
    right certificate the credential is still required."""
    url = cluster.url("prefill")
    assert url.startswith("https://")
    with pytest.raises(httpx.HTTPError):   # the port speaks TLS only
        httpx.get(url.replace("https://", "http://") + "/internal/info", headers=cluster.headers, timeout=10)
    no_cert = ssl.create_default_context(cafile=pki["ca"])
    with pytest.raises(httpx.HTTPError):   # no client certificate: the handshake fails
        httpx.get(url + "/internal/info", headers=cluster.headers, verify=no_cert, timeout=10)
    foreign = ssl.create_default_context(cafile=pki["ca"])
    foreign.load_cert_chain(pki["other_client_cert"], pki["other_client_key"])
    with pytest.raises(httpx.HTTPError):   # a certificate of another CA
        httpx.get(url + "/internal/info", headers=cluster.headers, verify=foreign, timeout=10)
    r = httpx.get(url + "/internal/info", timeout=10, **cluster.http_kwargs("prefill"))
    assert r.status_code == 401            # the right certificate, no credential
    assert cluster.info("prefill")["pd"]["role"] == "prefill"
