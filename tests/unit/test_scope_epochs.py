"""The PD node's table of retired scope generations (kvfence/pd/scope_epochs.py) and the
reload numbering it is fed from (TenantRegistry.succeed)."""
from __future__ import annotations

import tomllib
from concurrent.futures import Future

import pytest

from kvfence.pd.messages import ForgetTenantsBody, MessageError, PrefillBody, ScopeStamp
from kvfence.pd.scope_epochs import ScopeEpochs, ScopeGate, ScopeRetired
from kvfence.server.tenants import TenantRegistry, registry_change


def stamp(epoch: int, router: str = "r1") -> ScopeStamp:
    return ScopeStamp(router=router, epoch=epoch)


def test_older_refused_newer_retires_first_same_admitted():
    s = ScopeEpochs()
    assert s.admit(None, "bob") is False            # not from a router: no check
    assert s.admit(stamp(0), "bob") is False        # nothing retired anywhere
    assert s.admit(stamp(2), "bob") is True         # the node missed reload 2's message
    assert s.admit(stamp(2), "bob") is False        # retired once, not per request
    with pytest.raises(ScopeRetired, match="reload 2"):
        s.admit(stamp(0), "bob")                    # sent before the retirement: refused
    with pytest.raises(ScopeRetired):
        s.admit(stamp(1), "bob")
    assert s.admit(stamp(0), "alice") is False      # per tenant
    assert s.admit(stamp(0, "r2"), "bob") is False  # per router: another router's numbering
    assert s.admit(stamp(3), "bob") is True


def test_the_forget_message_retires_only_what_is_new_here():
    s = ScopeEpochs()
    assert s.forget("r1", 1, ["bob", "carol"]) == ["bob", "carol"]
    assert s.admit(stamp(1), "bob") is False        # the message came first: nothing more to do
    assert s.admit(stamp(2), "carol") is True       # a request of reload 2 came before its message
    assert s.forget("r1", 2, ["carol", "dave"]) == ["dave"]   # late: carol's new pages stay
    assert s.forget("r1", 1, ["bob"]) == []         # a duplicate
    with pytest.raises(ScopeRetired):
        s.admit(stamp(0), "dave")


def test_a_dropped_pair_errs_toward_retiring_again():
    s = ScopeEpochs(max_pairs=2)
    s.admit(stamp(1), "a")
    s.admit(stamp(1), "b")
    s.admit(stamp(1), "a")                          # used: b is now the oldest
    s.admit(stamp(1), "c")                          # b dropped
    assert s.admit(stamp(1), "a") is False
    assert s.admit(stamp(1), "b") is True           # forgotten: retired once more (cache only)
    # found in review: a stale epoch-0 request of a dropped pair went into the current scope
    s.admit(stamp(2), "d")
    s.admit(stamp(2), "e")                          # b (and more) dropped again
    assert s.admit(stamp(0), "b") is True           # unknown, from a router that dropped pairs: retire
    assert s.admit(stamp(0, "r2"), "b") is False    # another router dropped nothing


def test_a_retirement_that_did_not_happen_is_tried_again():
    s = ScopeEpochs()
    assert s.admit(stamp(1), "bob") is True
    s.retire_again("r1", "bob", 1)
    assert s.admit(stamp(1), "bob") is True
    assert s.admit(stamp(1), "bob") is False         # retired this time: once is enough
    # found in review: undo forgot the pair, and a stale stamp then went into the current scope
    assert s.forget("r1", 3, ["bob"]) == ["bob"]
    s.retire_again("r1", "bob", 3)                   # reload 3's retirement failed
    with pytest.raises(ScopeRetired):
        s.admit(stamp(0), "bob")
    assert s.admit(stamp(3), "bob") is True          # and reload 3's first request retires
    s.retire_again("r1", "bob", 3)
    assert s.forget("r1", 3, ["bob"]) == ["bob"]     # or its forget message, sent again


def test_a_failure_older_than_the_last_recorded_retirement_marks_nothing():
    """The newer retirement was queued after the failed one and retires the scope itself:
    marking the pair again cost every party of the name its cache once more."""
    s = ScopeEpochs()
    assert s.forget("r1", 1, ["bob"]) == ["bob"]
    assert s.forget("r1", 2, ["bob"]) == ["bob"]
    s.retire_again("r1", "bob", 1)                   # reload 1's retirement failed; 2's is queued after it
    assert s.admit(stamp(2), "bob") is False
    s.retire_again("r1", "alice", 0)                 # a pair never recorded: nothing to mark
    assert s.admit(stamp(0), "alice") is False


def test_an_earlier_failed_retirement_lets_no_stale_stamp_in_after_a_later_one():
    """Found in review: reloads 1 and 2 each queued a retirement, the first failed, and undoing
    it set the pair back to 1 while 2's went through: a request stamped 1 (its key revoked by
    reload 2) was then admitted into the scope of reload 2's party."""
    s = ScopeEpochs()
    assert s.forget("r1", 1, ["bob"]) == ["bob"]
    assert s.forget("r1", 2, ["bob"]) == ["bob"]
    s.retire_again("r1", "bob", 2)                   # reload 2's retirement failed, 1's ran
    with pytest.raises(ScopeRetired):
        s.admit(stamp(1), "bob")
    assert s.admit(stamp(2), "bob") is True          # retired once more


class Engine:
    """The engine's command queue as the gate sees it: retirements run (or raise) in order."""
    def __init__(self):
        self.queue: list[tuple[Future, list[str], str]] = []
        self.retired: list[tuple[str, str]] = []

    def retire(self, tenants: list[str], router: str) -> Future:
        f: Future = Future()
        self.queue.append((f, tenants, router))
        return f

    def run(self, fail: bool = False, first: int | None = None) -> None:
        """Run the queue, or its `first` commands only."""
        ran = self.queue[:first]
        for f, tenants, router in ran:
            if fail:
                f.set_exception(RuntimeError("the retirement raised"))
            else:
                self.retired += [(router, t) for t in tenants]
                f.set_result(len(tenants))
        del self.queue[:len(ran)]


def test_a_request_queued_behind_a_failed_retirement_learns_it():
    """Found in review: a request stamped with the forget message's own epoch was admitted
    while that message's retirement was queued; the retirement then failed, and the request
    ran in the scope it was to leave (the old party's cached prompts)."""
    eng = Engine()
    g = ScopeGate(eng.retire)
    assert g.forget("r1", 1, ["bob"]) is not None
    behind = g.admit(stamp(1), "bob")               # the same epoch: no retirement of its own
    assert behind is not None and len(eng.queue) == 1
    assert g.admit(stamp(0), "alice") is None      # another name retired nowhere: behind nothing
    eng.run(fail=True)
    assert g.unretired(behind)                      # so the node refuses it after its submission
    own = g.admit(stamp(1), "bob")                  # the next one retires again, and is told how it went
    assert own is not None and own is not behind and len(eng.queue) == 1
    eng.run()
    assert not g.unretired(own) and eng.retired == [("r1", "bob")]
    assert g.admit(stamp(1), "bob") is None         # retired: nothing pending, nothing to do


def test_a_request_admitted_behind_an_earlier_retirement_sees_its_own_last():
    eng = Engine()
    g = ScopeGate(eng.retire)
    first = g.forget("r1", 1, ["bob"])
    own = g.admit(stamp(2), "bob")                  # newer: its own retirement, queued after the first
    assert own is not first and len(eng.queue) == 2
    eng.queue[0][0].set_exception(RuntimeError("the first raised"))
    eng.queue.pop(0)
    eng.run()                                       # the second went through: the scope is retired
    assert not g.unretired(own)
    assert g.admit(stamp(2), "bob") is None         # and the first's failure marked nothing (reload 2 ran)


def test_a_retirement_that_cannot_even_be_queued_is_retried():
    def stopped(tenants, router):
        raise RuntimeError("the engine is failed")
    g = ScopeGate(stopped)
    with pytest.raises(RuntimeError):
        g.forget("r1", 1, ["bob"])
    eng = Engine()
    g._retire = eng.retire                          # the engine is back (a test's shortcut)
    assert g.admit(stamp(1), "bob") is not None     # recorded but never run: retired now


def test_the_stamp_and_the_forget_message_are_typed():
    body = {"request_id": "x", "tenant": "bob", "prompt_ids": [1], "params": {}}
    assert PrefillBody.from_json(body).scope is None
    for bad in ({"router": "r", "epoch": -1}, {"router": "", "epoch": 0}, {"router": "r", "epoch": 1.0},
                {"router": "r", "epoch": "1"}, {"router": "r"}, {"router": "r", "epoch": 0, "x": 1}):
        with pytest.raises(MessageError, match="scope"):
            PrefillBody.from_json({**body, "scope": bad})
    with pytest.raises(MessageError, match="epoch"):   # a forget names the reload that retired
        ForgetTenantsBody.from_json({"tenants": ["bob"], "router": "r", "epoch": 0})
    with pytest.raises(MessageError, match="router"):
        ForgetTenantsBody.from_json({"tenants": ["bob"], "epoch": 1})


FILE = """
[tenants.alice]
api_keys = ["sk-alice-000001"]
[tenants.bob]
api_keys = ["sk-bob-00000001"]
"""


def _reload(old: TenantRegistry, text: str) -> TenantRegistry:
    new = TenantRegistry.from_dict(tomllib.loads(text))
    new.succeed(old, registry_change(old, new)["retired"])
    return new


def test_reloads_number_the_retirements_and_a_name_keeps_its_epoch_while_it_is_gone():
    r0 = TenantRegistry.from_dict(tomllib.loads(FILE))
    assert r0.reloads == 0 and {t.scope_epoch for t in r0.tenants.values()} == {0}
    r1 = _reload(r0, FILE.replace("sk-bob-00000001", "sk-bob-00000002"))      # bob: another party
    assert r1.tenants["bob"].scope_epoch == 1 and r1.tenants["alice"].scope_epoch == 0
    assert r1.identify("Bearer sk-bob-00000002")[0].scope_epoch == 1          # what a lease holds
    r2 = _reload(r1, FILE.replace('[tenants.bob]\napi_keys = ["sk-bob-00000001"]\n', ""))  # bob removed
    assert r2.reloads == 2 and "bob" not in r2.tenants and r2.scope_epochs["bob"] == 2
    r3 = _reload(r2, FILE)                                                    # bob back: not retired now,
    assert r3.tenants["bob"].scope_epoch == 2                                 # but a node that missed 2 must
    assert registry_change(r3, TenantRegistry.from_dict(tomllib.loads(FILE)))["changed"] == []   # an epoch is
    r4 = _reload(r3, FILE.replace("[tenants.alice]", "[tenants.alice]\nmax_concurrent_requests = 2"))  # no edit
    assert r4.tenants["bob"].scope_epoch == 2 and r4.tenants["alice"].scope_epoch == 0
    assert r4.tenants["alice"].limits.max_concurrent_requests == 2
    assert registry_change(r3, r4)["changed"] == ["alice"]


def test_a_node_from_before_stamps_gets_messages_it_can_read():
    """A rolling upgrade, router first: a node whose info does not say scope_stamps refuses
    unknown fields, so the router sends it no stamp and the forget message without its epoch
    (found in review: every prefill request would have been a 400)."""
    import json

    from kvfence.pd.messages import NodeInfo
    from kvfence.pd.router import _json

    body = PrefillBody(request_id="x", tenant="bob", prompt_ids=[1, 2], params={}, scope=stamp(3))
    assert json.loads(_json(body)["content"])["scope"] == {"router": "r1", "epoch": 3}
    old = json.loads(_json(body, stamps=False)["content"])
    assert "scope" not in old and old["tenant"] == "bob"
    forget = ForgetTenantsBody(tenants=["bob"], router="r1", epoch=3)
    assert json.loads(_json(forget, stamps=False)["content"]) == {"tenants": ["bob"]}
    assert ForgetTenantsBody.from_json({"tenants": ["bob"]}).router is None   # what such a router sends
    assert "scope_stamps" in NodeInfo.model_fields and NodeInfo.model_fields["scope_stamps"].default is False
    from types import SimpleNamespace

    from kvfence.pd.router import _stamps
    assert _stamps(SimpleNamespace(info=SimpleNamespace(scope_stamps=True)))           # type: ignore[arg-type]
    assert not _stamps(SimpleNamespace(info=SimpleNamespace(scope_stamps=False)))      # type: ignore[arg-type]
    assert not _stamps(SimpleNamespace(info=None))                                     # type: ignore[arg-type]


def test_an_unstamped_request_behind_a_failed_unstamped_retirement_is_told_too():
    """A router from before stamps (a rolling upgrade): no epochs, but the same queue."""
    eng = Engine()
    g = ScopeGate(eng.retire)
    assert g.admit(None, "bob") is None
    forget = g.forget_unstamped(["bob"])
    assert g.admit(None, "bob") is forget and g.admit(stamp(0), "bob") is None   # stamped: another scope
    eng.run(fail=True)
    assert g.unretired(forget)
    again = g.admit(None, "bob")                    # found in review: it ran in the unretired scope
    assert again is not None and again is not forget and len(eng.queue) == 1
    eng.run()
    assert not g.unretired(again) and eng.retired == [(None, "bob")]
    assert g.admit(None, "bob") is None             # retired now: once is enough


def test_a_failed_unstamped_retirement_with_a_later_one_queued_is_not_retried():
    """The later retirement runs after it and retires the same plain scope (found in review:
    the failure marked the name anyway, and its next request flushed the scope a second time)."""
    eng = Engine()
    g = ScopeGate(eng.retire)
    g.forget_unstamped(["bob"])
    later = g.forget_unstamped(["bob"])
    eng.run(fail=True, first=1)
    eng.run()
    assert not g.unretired(later) and eng.retired == [(None, "bob")]
    assert g.admit(None, "bob") is None and eng.queue == []


def test_past_its_bound_a_failed_unstamped_retirement_makes_every_unstamped_request_retire_first():
    """The names marked to retire again are bounded; past the bound a failure was dropped, so
    that name's next request ran in the unretired scope. Now the gate fails closed."""
    eng = Engine()
    g = ScopeGate(eng.retire, max_pairs=2)
    g.forget_unstamped(["a", "b", "c"])
    eng.run(fail=True)
    for name in ("c", "zed"):          # c did not fit; zed never failed: both retire first now
        behind = g.admit(None, name)
        assert behind is not None and eng.queue[-1][1] == [name]
        eng.run()
        assert not g.unretired(behind)
    assert g.admit(stamp(0), "zed") is None and eng.queue == []   # a stamped scope: its own table


def test_a_decode_node_from_before_key_ids_gets_a_manifest_it_can_read():
    """A rolling upgrade, router first (review): a decode node whose info does not say
    seal_keys refuses the manifest's key id as an unknown field, so the router leaves it out;
    a new decode node reads a manifest without one (an old prefill's) as sealed with its own
    secret. The stamp's exclusion still applies beside it."""
    import json

    from kvfence.pd.messages import DecodeBody, Handoff, Manifest, NodeInfo, TransferSource
    from kvfence.pd.router import _json, _seal_keys

    m = Manifest(request_id="x", tenant="bob", token_count=1, page_count=1, page_size=16, epochs=[0],
                 fingerprint="f", layout="l", boot_id="b", seal_salt="0" * 32, seal_key="ab" * 8, slot_bytes=1,
                 slots=[1], lease_deadline=1.0)
    h = Handoff(manifest=m, source=TransferSource(session="s:1", base=0, boot_id="b"))
    body = DecodeBody(request_id="x", tenant="bob", prompt_ids=[1, 2], params={}, scope=stamp(3), handoff=h)
    assert json.loads(_json(body)["content"])["handoff"]["manifest"]["seal_key"] == "ab" * 8
    old = json.loads(_json(body, stamps=False, seal_keys=False)["content"])
    assert "seal_key" not in old["handoff"]["manifest"] and "scope" not in old
    assert old["handoff"]["manifest"]["seal_salt"] == "0" * 32
    assert Manifest.from_json(old["handoff"]["manifest"]).seal_key is None
    assert NodeInfo.model_fields["seal_keys"].default is False
    from types import SimpleNamespace
    assert _seal_keys(SimpleNamespace(info=SimpleNamespace(seal_keys=True)))           # type: ignore[arg-type]
    assert not _seal_keys(SimpleNamespace(info=SimpleNamespace(seal_keys=False)))      # type: ignore[arg-type]
