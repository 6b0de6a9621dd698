"""RouterRealms (engine/router_realms.py): which router processes a PD node holds scopes for,
and which are idle; and the ledger's side: a router's scopes retired together, names pruned,
ids never reused."""
from __future__ import annotations

import pytest

from kvfence.engine.router_realms import RouterRealms
from kvfence.kv.ledger import BlockTable, Ledger, Owner, scope_name


def test_idle_routers_come_due_oldest_first_and_once():
    r = RouterRealms(60)
    assert r.next_due() is None and r.due(1e9) == []
    r.seen("a", 100)
    r.seen("b", 110)
    r.seen("a", 130)                       # heard again: now the most recent
    assert r.next_due() == 170             # b's
    assert r.due(169) == []
    assert r.due(170) == ["b"] and r.due(1000) == ["a"] and len(r) == 0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_a_nonsense_idle_time_is_refused(bad):
    with pytest.raises(ValueError, match="idle"):
        RouterRealms(bad)


def test_a_routers_scopes_retire_together_and_their_names_go_once_unused():
    led = Ledger(16, 4)
    pages = {}
    for router in ("r1", "r2"):
        for scope in (scope_name("A", router=router), scope_name("A", "docs", router)):
            o, t = Owner(led.tenant_id(scope), len(pages) + 1), BlockTable()
            led.allocate(o, 1, t)
            led.mark_written(o, t, 0, 4)
            assert led.publish(o, t.pages[0], t.epochs[0])
            pages[(router, scope)] = t.pages[0]
            led.free(o, t)                     # the request ended: the page stays, cached
    r1 = led.tenant_id(scope_name("A", router="r1"))
    assert led.retire_realm("r1") == 2 and led.retire_realm("r1") == 0
    assert led.pages_by_owner()["shared"] == {"A": 1, "public:docs": 1}   # r2's, by name
    assert led.prune_names(live={r1}) == 1          # r1's public scope; its A is still in use
    assert led.prune_names(live=set()) == 1 and led.tenant_name(r1) is None
    fresh = led.tenant_id(scope_name("A", router="r1"))
    assert fresh not in (r1,) and fresh > max(led._names.keys() - {fresh})   # ids are never reused
    led.check_consistency()


def test_the_idle_time_reaches_a_nodes_settings_and_launch_pd_passes_it_on():
    """--router-scope-idle on `serve --role prefill|decode` is the node's PDSettings, which
    build_node_engine gives the engine's RouterRealms; launch-pd passes it to every node."""
    from kvfence.cli import _pd_settings, build_parser
    from kvfence.pd.launch import PD_FLAGS, flags
    from kvfence.pd.seal import Keyring, SecretSet
    from kvfence.pd.settings import PDSettings

    a = build_parser().parse_args(["serve", "--role", "prefill", "--router-scope-idle", "5"])
    assert _pd_settings(a, "prefill", Keyring(SecretSet(b"s" * 32))).router_scope_idle_s == 5
    assert flags(a, PD_FLAGS)[-2:] == ["--router-scope-idle", "5.0"]
    a = build_parser().parse_args(["launch-pd", "--router-scope-idle", "7"])
    assert "--router-scope-idle" in flags(a, PD_FLAGS)
    with pytest.raises(ValueError, match="router_scope_idle_s"):
        PDSettings("decode", router_scope_idle_s=0, cluster_secret=b"s" * 32)
