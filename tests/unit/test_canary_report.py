"""The canary harness's own logic, without a server: canaries are unique and found in any
spelling the model produces, and the report's verdict and exit code follow its findings."""
from __future__ import annotations

import random

from kvfence.canary import CanaryReport, Leak, NodeState, RequestResult, find_canaries, load_tenant_keys, make_canaries


def test_canaries_are_unique_down_to_their_parts():
    owners = make_canaries([f"t{i}" for i in range(40)], random.Random(0), per_tenant=3)
    parts = [p for cs in owners.values() for c in cs for p in c.split("-")[:2]]
    assert len(parts) == len(set(parts)) == 40 * 3 * 2


def test_find_canaries_whole_fragment_and_spelling():
    owners = {"a": ("QX-7731-ZEBRA",), "b": ("KD-4410-RAVEN",)}
    assert find_canaries("my code is qx - 7731 - zebra.", owners) == [("a", "QX-7731-ZEBRA", "whole")]
    assert find_canaries("...KD-4410-RAVE", owners) == [("b", "KD-4410-RAVEN", "fragment")]
    assert find_canaries("code 4410-RAVEN", owners) == [("b", "KD-4410-RAVEN", "fragment")]
    assert find_canaries("7731 and RAVEN apart, QX alone", owners) == []


def test_load_tenant_keys_skips_hash_only_tenants(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('[tenants.a]\napi_keys = ["sk-aaaa-0001", "sk-aaaa-0002"]\n'
                 '[tenants.h]\napi_key_sha256 = ["00"]\n')
    assert load_tenant_keys(f) == {"a": "sk-aaaa-0001"}


def _report(**kw) -> CanaryReport:
    r = CanaryReport("http://x", "pd", 0, 1024, 1440, 2)
    r.nodes = {"decode": NodeState("decode", "http://d", audit_enabled=True)}
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_report_verdicts_and_exit_codes():
    assert _report().clean and _report().exit_code() == 0
    leak = _report(leaks=[Leak(1, "a", "b", "KD-4410-RAVEN", "whole", "over_total", "...")])
    assert leak.leaked and leak.exit_code() == 1 and "LEAK DETECTED" in leak.text()
    audit = _report()
    audit.nodes["decode"].audit_violations, audit.nodes["decode"].audit_by_kind = 3, {"read_unwritten": 3}
    assert audit.leaked and audit.audit_by_kind == {"read_unwritten": 3} and audit.exit_code() == 1
    for finding in (dict(over_length_200=[2]), dict(hung=[1]), dict(pages_not_returned={"decode": "1 owned"})):
        r = _report(**finding)
        assert not r.leaked and not r.clean and r.exit_code() == 1 and "FINDINGS" in r.text()
    blind = _report(problems=["decode node runs without the read audit"])
    assert not blind.clean and blind.exit_code() == 2 and "INCONCLUSIVE" in blind.text()


def test_request_outcomes():
    r = RequestResult(0, "a", "probe", "chat", True, 10, 4, False, None, status=200, finish_reason="length")
    assert r.outcome == "200 length"
    r.error_code = "isolation_violation"
    assert r.outcome == "200 isolation_violation"   # a stream that started, then failed
    assert RequestResult(1, "a", "normal", "completions", False, 10, 4, False, "after 1 s",
                         client_aborted=True).outcome == "client_aborted"


def test_unknown_canary_shapes_are_reported_apart():
    from kvfence.canary import unknown_canaries

    owners = {"a": ("QX-7731-ZEBRA",), "b": ("KD-4410-RAVEN",)}
    text = "codes: MM-1234-TOPAZ, QX-7713-ZEBRA, KD-4410-RAVEN, AB-12-CD"
    assert unknown_canaries(text, owners, "a") == ["MM-1234-TOPAZ"]   # the mutation of a's own is not counted
