"""What a tenant's view of the isolation statement says of a PD fleet's pools: one per role,
the smallest that may serve it, whatever is up now (server/isolation.py tenant_view)."""
from __future__ import annotations

from types import SimpleNamespace

from kvfence.server.isolation import tenant_view


def _pool(node: str, role: str, pages: int, state: str = "ready", fits: bool = True) -> dict:
    return {"node": node, "role": role, "state": state, "pages": pages, "page_size_tokens": 16,
            "capacity_tokens": pages * 16, "bytes": pages * 1000, "advertised_context_fits": fits}


def _view(pools: list[dict]) -> list[dict]:
    statement = {"kv_memory_isolation": {"tenancy": {}}, "capacity": {"pools": pools},
                 "incident_disclosure": {}, "live": {}}
    tenant = SimpleNamespace(public_prefix_scope=None, limits=SimpleNamespace(max_prompt_tokens=None))
    return tenant_view(statement, tenant)["capacity"]["pools"]


def test_a_tenant_cannot_count_the_fleet_or_see_a_node_go_down():
    """A security probe counted the ready nodes of each role in the tenant's view, and by
    polling saw one drop out. Two prefill and three decode nodes, one of each down: the
    tenant sees the same two entries as with all of them up."""
    up = [_pool("http://p1", "prefill", 90), _pool("http://p2", "prefill", 120),
          _pool("http://d1", "decode", 80), _pool("http://d2", "decode", 100), _pool("http://d3", "decode", 100)]
    down = [dict(p, state="failed") if p["node"] in ("http://p1", "http://d2") else p for p in up]
    view = _view(up)
    assert view == _view(down)
    assert [(p["role"], p["pages"]) for p in view] == [("prefill", 90), ("decode", 80)]   # the smallest of each
    assert all("node" not in p and "state" not in p for p in view)


def test_a_node_the_capacity_check_refused_is_not_the_bound():
    pools = [_pool("http://p1", "prefill", 10, state="refused", fits=False), _pool("http://p2", "prefill", 90),
             _pool("http://d1", "decode", 80),
             _pool("http://d2", "decode", 20, state="refused")]   # refused for another model or dtype
    assert [(p["role"], p["pages"]) for p in _view(pools)] == [("prefill", 90), ("decode", 80)]


def test_a_single_nodes_pool_is_shown_without_its_name():
    (pool,) = _view([{"node": "local", "pages": 90, "page_size_tokens": 16, "capacity_tokens": 1440, "bytes": 1,
                      "advertised_context_fits": True}])
    assert pool["pages"] == 90 and "node" not in pool


def test_a_node_without_client_certificates_is_warned_of():
    """--allow-plaintext-network also lets a node off loopback run without --tls-ca: the
    statement said only that traffic may cross in the clear (review)."""
    from kvfence.server.isolation import _pd_terms

    open_node = {"pd": {}, "pd_security": {"tls": True, "client_certificates_required": False,
                                           "plaintext_network_allowed": True}}
    assert any("no client certificate" in w for w in _pd_terms(open_node)["warnings"])
    mtls = {"pd": {}, "pd_security": {"tls": True, "client_certificates_required": True,
                                      "plaintext_network_allowed": True}}
    assert not any("no client certificate" in w for w in _pd_terms(mtls)["warnings"])
    # a router (its facts are a decode node's with its cluster check): its API takes API keys
    router = {"pd": {}, "cluster": {}, "pd_security": dict(open_node["pd_security"])}
    assert not any("no client certificate" in w for w in _pd_terms(router)["warnings"])
