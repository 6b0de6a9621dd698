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

A second topology puts two prefill hosts and one decode host in three namespaces (drawn
below): the router routes to both prefill nodes, and each one's KV crosses its own veth.
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
from pd_cluster import Cluster, MultiCluster, wait_until
from test_cluster import LONG, model_name, single_node_text

from kvfence.engine.params import SamplingParams

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
    assert pulled > 20 * 360_000  # the long prompt's bf16 pages (368,640 B each) crossed over ...
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


# -- two prefill hosts, one decode host ---------------------------------------------------------------
#
#   ns A (prefill)   --veth--  ns C (decode)  --veth--  ns B (prefill-2)
#   10.231.B.1 ====== .2            .6 ====== .5                              (KV, one /30 each)
#   each of A, B, C also has its own veth to the root namespace (router, test): .9/.10, .13/.14, .17/.18
#
# Decode advertises 10.231.B.21, an address on its own loopback that A and B reach only over
# their own veth to C; each prefill advertises its end of its own link to C, so a pull from A
# can only cross A<->C and a pull from B only B<->C. The proof, per request: the router's
# `routed` count says which prefill served it, decode says how many bytes it pulled, and the
# receive counter of that prefill's veth end in C grew by at least that much (the other one's
# by far less).
PREFILLS = ("prefill", "prefill-2")
NODES3 = {"prefill": "prefill", "prefill-2": "prefill", "decode": "decode"}


@pytest.fixture(scope="module")
def three_hosts():
    """Three network namespaces (prefill, prefill-2, decode) with the links drawn above;
    always torn down, whatever failed."""
    if os.geteuid() != 0:
        pytest.skip("multi-host PD test: creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("multi-host PD test: no `ip` command (Debian package iproute2)")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(256):02x}"
    x = {"prefill": "a", "prefill-2": "b", "decode": "c"}
    ns = {n: f"kvf{tag}{x[n]}" for n in NODES3}
    # interface names (at most 15 characters): kvf<tag><this end><other end>, r = the root namespace
    kv_prefill_end = {n: f"kvf{tag}{x[n]}c" for n in PREFILLS}     # in the prefill's namespace
    kv_decode_end = {n: f"kvf{tag}c{x[n]}" for n in PREFILLS}      # in decode's namespace
    root_end = {n: f"kvf{tag}r{x[n]}" for n in NODES3}
    node_end = {n: f"kvf{tag}{x[n]}r" for n in NODES3}
    created: list[str] = []
    try:
        r = _ip("netns", "add", ns["prefill"], check=False)
        if r.returncode != 0:
            pytest.skip(f"multi-host PD test: cannot create a network namespace here: {r.stderr.strip()}")
        created.append(ns["prefill"])
        for n in ("prefill-2", "decode"):
            _ip("netns", "add", ns[n])
            created.append(ns[n])
        net = f"10.231.{_free_subnet()}"
        kv_link = {"prefill": (f"{net}.1", f"{net}.2"), "prefill-2": (f"{net}.5", f"{net}.6")}  # (prefill, decode)
        http_addr = {"prefill": f"{net}.10", "prefill-2": f"{net}.14", "decode": f"{net}.18"}
        root_addr = {"prefill": f"{net}.9", "prefill-2": f"{net}.13", "decode": f"{net}.17"}
        kv_addr = {"prefill": kv_link["prefill"][0], "prefill-2": kv_link["prefill-2"][0], "decode": f"{net}.21"}
        for n in NODES3:
            _ip("-n", ns[n], "link", "set", "lo", "up")
        _ip("-n", ns["decode"], "addr", "add", f"{kv_addr['decode']}/32", "dev", "lo")
        for n in PREFILLS:
            _ip("link", "add", kv_prefill_end[n], "netns", ns[n], "type", "veth",
                "peer", "name", kv_decode_end[n], "netns", ns["decode"])
            ends = ((n, kv_prefill_end[n], kv_link[n][0]), ("decode", kv_decode_end[n], kv_link[n][1]))
            for where, dev, addr in ends:
                _ip("-n", ns[where], "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns[where], "link", "set", dev, "up")
            # decode's transfer address: reached from this prefill host over its own link only
            _ip("-n", ns[n], "route", "add", f"{kv_addr['decode']}/32", "dev", kv_prefill_end[n])
        for n in NODES3:
            _ip("link", "add", root_end[n], "type", "veth", "peer", "name", node_end[n], "netns", ns[n])
            _ip("addr", "add", f"{root_addr[n]}/30", "dev", root_end[n])
            _ip("link", "set", root_end[n], "up")
            _ip("-n", ns[n], "addr", "add", f"{http_addr[n]}/30", "dev", node_end[n])
            _ip("-n", ns[n], "link", "set", node_end[n], "up")
        yield {"ns": ns, "kv_addr": kv_addr, "http_addr": http_addr, "kv_prefill_end": kv_prefill_end,
               "kv_decode_end": kv_decode_end}
    finally:
        for n in NODES3:
            _ip("link", "del", root_end[n], check=False)  # deletes both ends of the pair
        for name in created:
            _ip("netns", "del", name, check=False)        # and with a namespace, the veths in it


@pytest.fixture(scope="module")
def cluster3(three_hosts, tmp_path_factory):
    """Two prefill nodes and one decode node, each in its own namespace, serving HTTPS with
    client certificates (mTLS); the router in the root namespace takes turns between the
    prefill nodes (--prefill-routing round-robin), so a few requests reach both for certain."""
    h = three_hosts
    pki = make_pki(tmp_path_factory.mktemp("pki3"), [h["http_addr"][n] for n in NODES3])
    c = MultiCluster(tmp_path_factory.mktemp("pd-netns3"), NODES3, hosts=dict(h["http_addr"]),
                     binds=dict.fromkeys(NODES3, "0.0.0.0"), transfer_hosts=dict(h["kv_addr"]),
                     prefixes={n: ["ip", "netns", "exec", h["ns"][n]] for n in NODES3}, pki=pki,
                     router_args=["--prefill-routing", "round-robin"])
    try:
        yield c.start_all()
    finally:
        c.stop()


def test_each_prefill_host_is_reached_from_decode_only_over_its_own_veth(three_hosts):
    h = three_hosts
    for n in PREFILLS:
        route = _ip("-n", h["ns"]["decode"], "route", "get", h["kv_addr"][n]).stdout
        assert f"dev {h['kv_decode_end'][n]}" in route, route
        back = _ip("-n", h["ns"][n], "route", "get", h["kv_addr"]["decode"]).stdout
        assert f"dev {h['kv_prefill_end'][n]}" in back, back
    other = _ip("-n", h["ns"]["prefill"], "route", "get", h["kv_addr"]["prefill-2"], check=False)
    assert other.returncode != 0 or "unreachable" in other.stdout + other.stderr   # no path between prefill hosts


def test_two_prefill_hosts_each_transfer_crosses_its_own_veth(three_hosts, cluster3, make_llm):
    """The router sends requests to both prefill hosts; each request's KV crosses the veth
    of the prefill node that served it into decode's namespace (its receive counter grew by
    at least the bytes decode pulled; the other prefill's veth by far less), and greedy
    output equals a single node's."""
    h, c = three_hosts, cluster3
    for n in PREFILLS:
        assert c.info(n)["pd"]["transfer_session"].startswith(h["kv_addr"][n] + ":")
    assert c.info("decode")["pd"]["transfer_session"].startswith(h["kv_addr"]["decode"] + ":")
    state = httpx.get(c.url("router") + "/v1/kvfence/cluster", timeout=10).json()
    assert state["ready"] and sorted(n["role"] for n in state["nodes"]) == ["decode", "prefill", "prefill"], state
    assert all(n["state"] == "ready" for n in state["nodes"]), state

    client = openai.OpenAI(base_url=c.url("router") + "/v1", api_key="none", max_retries=0, timeout=120)
    m = model_name(client)
    ns_d = h["ns"]["decode"]
    want: dict[str, str] = {}
    llm: dict = {}
    seen = {n: {"requests": 0, "long": 0, "pulled": 0, "own": 0, "other": 0} for n in PREFILLS}

    def one(prompt: str) -> str:
        routed = {x["url"]: x["routed"] for x in c.routed_nodes()}
        dec = c.pd("decode")
        rx = {n: _rx_bytes(ns_d, h["kv_decode_end"][n]) for n in PREFILLS}
        r = client.completions.create(model=m, prompt=prompt, max_tokens=16, temperature=0)
        if prompt not in want:
            llm.setdefault("llm", make_llm(max_model_len=1024))   # one single node for every prompt
            want[prompt] = llm["llm"].generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].text
        assert r.choices[0].text == want[prompt], prompt[:40]
        after = wait_until(lambda: (d := c.pd("decode")).get("pd_verified", 0) > dec.get("pd_verified", 0) and d,
                          30, "decode to count the verified transfer")   # (counters appear with their first count)
        now = {x["url"]: x["routed"] for x in c.routed_nodes()}
        served = [n for n in PREFILLS if now[c.url(n)] > routed[c.url(n)]]
        assert len(served) == 1, (routed, now)
        (n,) = served
        (o,) = [x for x in PREFILLS if x != n]
        s = seen[n]
        s["requests"] += 1
        s["long"] += prompt == LONG
        s["pulled"] += after["transferred_bytes"] - dec.get("transferred_bytes", 0)
        s["own"] += _rx_bytes(ns_d, h["kv_decode_end"][n]) - rx[n]
        s["other"] += _rx_bytes(ns_d, h["kv_decode_end"][o]) - rx[o]
        return n

    for _ in range(6):        # turns alternate; bounded in case a node sat out a turn
        one(LONG)             # 300+ tokens: 20+ pages cross
        if all(seen[n]["long"] for n in PREFILLS):
            break
    for p in ("The capital of France is", "Write a haiku about the sea.\n"):
        one(p)
    print("per prefill node:", seen)
    for n, s in seen.items():
        assert s["long"] >= 1, seen                      # the router routed to both prefill nodes
        assert s["pulled"] > 20 * 360_000, (n, s)        # the long prompt's pages came from this node ...
        assert s["own"] >= s["pulled"], (n, s)           # ... over its own veth into decode's namespace ...
        assert s["other"] < s["pulled"] // 10, (n, s)    # ... and not over the other prefill's
    state = httpx.get(c.url("router") + "/v1/kvfence/cluster", timeout=10).json()
    assert all(x["routed"] > 0 for x in state["nodes"]), state["nodes"]
    c.wait_quiet()
