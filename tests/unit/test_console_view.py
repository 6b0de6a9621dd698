"""The operator console's numbers without a server: the ledger's per-tenant page counts,
one pool's view of a snapshot, the router's nodes and pools, and the console cookie."""
from __future__ import annotations

import time

from test_fleet_routing import fleet, info

from kvfence.kv.ledger import BlockTable, Ledger, Owner
from kvfence.pd.router import RouterBackend
from kvfence.server.app import ServerState
from kvfence.server.console import OperatorAuth
from kvfence.server.console_view import console_view, pool_of
from kvfence.server.tenants import TenantRegistry


def test_the_ledger_counts_pages_by_tenant_and_cache_scope_and_fenced_ones():
    led = Ledger(32, 4)
    alice, bob, docs = led.tenant_id("alice"), led.tenant_id("bob"), led.tenant_id("\0public:docs")
    a, b, p = Owner(alice, 1), Owner(bob, 2), Owner(bob, 3, scope=docs)
    ta, tb, tp = BlockTable(), BlockTable(), BlockTable()
    led.allocate(a, 3, ta)
    led.allocate(b, 5, tb)
    led.allocate(p, 2, tp)
    led.mark_written(p, tp, 0, 8)
    for page, epoch in zip(tp.pages, tp.epochs, strict=True):
        assert led.publish(p, page, epoch)
    assert led.pages_by_owner() == {"owned": {"alice": 3, "bob": 5}, "shared": {"public:docs": 2}}
    assert led.page_owner(tp.pages[0]) == "public:docs"       # no NUL in a name handed out
    assert led.num_fenced == 0
    fenced = led.fence(b, tb, "test", until=time.time() + 60)
    assert len(fenced) == 5 and led.num_fenced == 5 and led.num_quarantined == 5
    assert led.pages_by_owner()["owned"] == {"alice": 3}
    led.lift_fence(2)
    assert led.num_fenced == 0 and led.num_quarantined == 0


def test_a_pools_states_are_disjoint_and_add_up():
    snap = {"pages_total": 90, "pages_free": 70, "pages_owned": 12, "pages_shared": 3, "pages_quarantined": 5,
            "pages_fenced": 2, "pages_by_owner": {"owned": {"alice": 8, "bob": 4}, "shared": {"alice": 3}},
            "pd": {"buffer_rows": 16, "buffer_free": 10, "buffer_fenced": 2}}
    p = pool_of("local", "single", snap)
    assert p is not None
    assert p["quarantined"] == 3 and p["fenced"] == 2 and p["owned"] == {"alice": 8, "bob": 4}
    assert p["free"] + sum(p["owned"].values()) + sum(p["shared"].values()) + p["quarantined"] + p["fenced"] == 90
    assert p["buffer"] == {"rows": 16, "free": 10, "fenced": 2, "held": 4}
    assert pool_of("x", "decode", {}) is None


def test_the_router_shows_itself_every_node_with_its_checks_and_each_pool():
    backend = RouterBackend(["http://p1"], ["http://d1"], b"s" * 32)
    backend.fleet = f = fleet()
    f.observe(f.nodes[0], info(usable=512, boot="small"))            # refused by the capacity check (I8)
    view = console_view(ServerState(backend, TenantRegistry.single()))
    assert view["role"] == "router" and view["isolation"] is None and view["isolation_unavailable"]
    names = [n["name"] for n in view["nodes"]]
    assert names == ["router"] + [n.url for n in f.nodes]
    p1 = view["nodes"][1]
    assert p1["state"] == "refused" and p1["checks"][0]["status"] == "failed" and "512" in p1["checks"][0]["detail"]
    assert {c["name"] for c in view["nodes"][2]["checks"]} >= {"read checks before every forward pass"}
    assert [p["node"] for p in view["pools"]] == [n.url for n in f.nodes]
    assert view["pools"][0]["free"] == 80 and view["incidents"]["note"]
    # the router's retries by stage, from its metrics (what its snapshot counts)
    backend.snapshot = {**backend.snapshot, "pd_retries": {"prefill": 2, "decode": 0, "handoff": 1}}
    retried = console_view(ServerState(backend, TenantRegistry.single()))["requests"]["pd_retries"]
    assert retried == {"prefill": 2.0, "decode": 0.0, "handoff": 1.0}


def test_the_console_cookie_is_the_operators_only_and_holds_no_key():
    reg = TenantRegistry.from_dict({"tenants": {"acme": {"api_keys": ["sk-acme-0001"]}},
                                    "operator": {"api_keys": ["op-key-000001"]}})
    auth = OperatorAuth(ServerState(RouterBackend(["http://p"], ["http://d"], b"s" * 32), reg))
    assert auth.cookie_for("sk-acme-0001") is None and auth.cookie_for("wrong") is None
    value = auth.cookie_for("op-key-000001")
    assert value is not None and "op-key" not in value
    assert auth._cookie_ok(value)
    exp, _, mac = value.partition(".")
    assert not auth._cookie_ok(f"{exp}.{'0' * len(mac)}")
    assert not auth._cookie_ok(f"{int(exp) + 1}.{mac}")                 # the expiry is under the MAC
    assert not auth._cookie_ok(f"{int(time.time()) - 1}.{auth._mac(reg.operator_digests[0], int(time.time()) - 1)}")
    other = OperatorAuth(ServerState(RouterBackend(["http://p"], ["http://d"], b"s" * 32), reg))
    assert not other._cookie_ok(value)                                    # another process's secret


def test_histogram_quantiles_interpolate_within_the_bucket_as_prometheus_does():
    from kvfence.server.console_view import histogram_quantile

    inf = float("inf")
    # 10 observations: 4 up to 0.1 s, 4 more up to 0.5 s, 2 above 1 s
    b = [(0.1, 4.0), (0.5, 8.0), (1.0, 8.0), (inf, 10.0)]
    assert histogram_quantile(0.5, b) == 0.1 + 0.4 * (1 / 4)     # rank 5: a quarter into (0.1, 0.5]
    assert histogram_quantile(0.2, b) == 0.05                   # rank 2: half of (0, 0.1]
    assert histogram_quantile(0.95, b) == 1.0                   # in +Inf: the last finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (inf, 0.0)]) is None and histogram_quantile(0.5, []) is None


def test_mid_rotation_the_console_shows_each_processs_key_ids_and_a_node_that_refuses_the_router():
    """The router's page during a rotation: the key id it sends with and its last reload of
    the secret files, each node's key ids, and a node that does not accept the router's key
    marked failed; a reload that failed is marked too. Key ids only: no secret on the page."""
    import json

    from kvfence.pd.seal import Keyring, SecretSet, key_id

    old, new = b"o" * 40, b"n" * 40
    backend = RouterBackend(["http://p1"], ["http://d1"], Keyring(SecretSet(new)))
    backend.fleet = f = fleet()
    state = ServerState(backend, TenantRegistry.single())
    state.keyring = backend.keyring
    f.observe(f.nodes[0], info(boot=f.nodes[0].url, secret_key_ids=[key_id(new), key_id(old)]))
    f.observe(f.nodes[1], info(boot=f.nodes[1].url, secret_key_ids=[key_id(old)]))
    state.last_secret_reload = {"at": time.time(), "trigger": "SIGHUP", "result": "ok"}
    view = console_view(state)

    def secret_check(node: dict) -> dict:
        return next(c for c in node["checks"] if c["name"] == "cluster secret")

    router = secret_check(view["nodes"][0])
    assert f"sends with key id {key_id(new)}" in router["detail"] and "(SIGHUP)" in router["detail"]
    p1, p2 = secret_check(view["nodes"][1]), secret_check(view["nodes"][2])
    assert p1["status"] == "passed" and f"seals with key id {key_id(new)}; also accepts {key_id(old)}" in p1["detail"]
    assert p2["status"] == "failed" and f"does not accept {key_id(new)}" in p2["detail"]
    state.last_secret_reload = {"at": time.time(), "trigger": "SIGHUP", "result": "error", "error": "mode 644"}
    failed = secret_check(console_view(state)["nodes"][0])
    assert failed["status"] == "failed" and "mode 644" in failed["detail"]
    page = json.dumps(console_view(state))
    assert old.decode() not in page and new.decode() not in page


def test_a_router_still_waiting_for_its_nodes_calls_itself_a_router():
    """Before its fleet is up the router's page said "single" and its secret row "seals with"
    (found in review): it is the router, with no node or pool yet, and it sends with its key."""
    from kvfence.pd.seal import Keyring, SecretSet, key_id

    backend = RouterBackend(["http://p1"], ["http://d1"], Keyring(SecretSet(b"n" * 40)))
    state = ServerState(backend, TenantRegistry.single())
    state.keyring = backend.keyring
    view = console_view(state)
    assert view["role"] == "router" and [n["name"] for n in view["nodes"]] == ["router"] and view["pools"] == []
    row = next(c for c in view["nodes"][0]["checks"] if c["name"] == "cluster secret")
    assert row["detail"] == f"sends with key id {key_id(b'n' * 40)}"
