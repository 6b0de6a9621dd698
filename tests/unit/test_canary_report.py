"""The canary harness's own logic, without a server: canaries are unique and found in any
spelling the model produces, and the report's verdict and exit code follow its findings."""
from __future__ import annotations

import random

import pytest

from kvfence.canary import (
    CanaryReport,
    Leak,
    NodeState,
    RequestResult,
    _Planned,
    find_canaries,
    load_tenant_keys,
    make_canaries,
    split_for_kills,
)


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


def _result(i: int, kind: str = "normal", status: int | None = 200, text: str = "fine words",
            tenant: str = "a") -> RequestResult:
    return RequestResult(i, tenant, kind, "completions", False, 10, 4, kind.startswith("over"), None, status=status,
                         error_code=None if status == 200 else "context_length_exceeded" if kind.startswith("over")
                         else "x", finish_reason="length", text=text)


def test_a_run_where_nothing_was_answered_is_inconclusive_not_clean():
    # found in review: every request refused (a wrong key, a node down) gave CLEAN
    from kvfence.canary import judge

    r = _report()
    judge(r, [_result(0, status=401), _result(1, "probe", status=503), _result(2, "over_prompt", status=400)])
    assert not r.clean and r.exit_code() == 2 and "nothing was read back" in r.text()
    ok = _report()
    judge(ok, [_result(0), _result(1, "over_prompt", status=400)])
    assert ok.clean and ok.exit_code() == 0
    leaked = _report()
    judge(leaked, [_result(0), _result(1, "over_total", status=200)])
    assert leaked.over_length_200 == [1] and leaked.exit_code() == 1


def test_options_that_would_hang_or_look_at_nothing_are_refused():
    from kvfence.canary import CanaryOptions
    for bad in ({"concurrency": 0}, {"num_requests": 0}, {"probe_fraction": 1.5}, {"timeout_s": 0},
                {"max_tokens": (0, 4)}, {"max_tokens": (5, 4)}, {"warmup_requests": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CanaryOptions(**bad)


def test_discover_audits_every_node_of_a_fleet_not_the_first_of_each_role():
    # found in review: only the first node per role was snapshotted, so a leak counted by the
    # read audit on a fleet's second decode node still gave CLEAN
    import asyncio

    import httpx

    from kvfence.canary import Canary

    nodes = [{"role": "prefill", "url": "http://p1"}, {"role": "prefill", "url": "http://p2"},
             {"role": "decode", "url": "http://d1"}, {"role": "decode", "url": "http://d2"},
             {"role": "decode", "url": "http://d3"}]
    check = {"usable_context": 1024, "nodes": {n["url"]: {"pool_tokens": 4096, "page_size": 16} for n in nodes}}

    def answer(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 1024}]})
        if req.headers.get("authorization") != "Bearer sk-scrape-01":   # as the router: nodes to the key only
            return httpx.Response(200, json={"ready": True, "usable_context": 1024, "detail": "needs the key"})
        return httpx.Response(200, json={"ready": True, "check": check, "nodes": nodes})

    async def go(given, scrape_key="sk-scrape-01"):
        c = Canary("http://router", {"a": "sk-aaaaaaaa"}, nodes=given, scrape_key=scrape_key)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await c._discover(client)
        return c.node_urls

    assert asyncio.run(go(None)) == {"prefill": "http://p1", "prefill-2": "http://p2", "decode": "http://d1",
                                     "decode-2": "http://d2", "decode-3": "http://d3"}
    # a tenants file without a [metrics] or [operator] key: said, not taken for a single node
    with pytest.raises(ValueError, match=r"\[metrics\]"):
        asyncio.run(go(None, scrape_key=None))
    # nodes named on the command line are exactly the nodes watched (found in review: the
    # router's list was added to them), written as the router writes them
    assert asyncio.run(go({"prefill": "http://p2/", "decode": "http://d2"})) == {"prefill": "http://p2",
                                                                                  "decode": "http://d2"}


def test_a_refused_warm_up_or_a_tenant_never_answered_is_inconclusive():
    """A docs probe: CLEAN although one tenant's warm-up (its canary) was refused by its prompt
    cap and another tenant's requests were all 429: their canaries never entered the pool."""
    from kvfence.canary import judge

    r = _report()
    warm = _result(0, "warm", status=400)
    warm.error_code = "tenant_max_prompt_tokens"
    judge(r, [warm, _result(1)])
    assert not r.clean and r.exit_code() == 2 and "warm-up request 0" in r.text(), r.text()
    r = _report()
    judge(r, [_result(0, tenant="a"), _result(1, tenant="b", status=429), _result(2, tenant="b", status=429)])
    assert not r.clean and "no request of tenant b" in r.text(), r.text()
    r = _report()   # a tenant whose only requests were over-length or abandoned by plan is no finding
    aborted = _result(2, tenant="c", status=None)
    aborted.client_aborted = True
    judge(r, [_result(0, tenant="a"), _result(1, "over_prompt", tenant="b", status=400), aborted])
    assert r.clean, r.text()


def test_a_stream_that_errored_and_an_untested_context_check_are_inconclusive():
    """Review: a 200 stream that ended in an error event read nothing back; over-length requests
    all refused by a prompt cap never reached the context check, the incident's path. One that
    another defense refused did reach it (the canary's layer-off runs)."""
    from kvfence.canary import judge

    errored = _result(1, tenant="b")
    errored.error_code = "node_failed"
    r = _report()
    judge(r, [_result(0, tenant="a"), errored])
    assert "no request of tenant b" in r.text(), r.text()
    capped = _result(1, "over_prompt", status=400)
    capped.error_code = "tenant_max_prompt_tokens"
    r = _report()
    judge(r, [_result(0), capped])
    assert not r.clean and "reached the context check" in r.text(), r.text()
    for code in ("context_length_exceeded", "kv_manifest_invalid"):
        refused = _result(1, "over_prompt", status=400)
        refused.error_code = code
        r = _report()
        judge(r, [_result(0), refused])
        assert r.clean, r.text()


def test_split_for_kills_sends_an_answerable_request_of_every_tenant_after_the_kills():
    """Seed 11 of the PD canary put tenants' only in-context requests in the kill window:
    under load they all failed and the run was INCONCLUSIVE by timing alone."""
    def planned(i, tenant, over=False, abort=None):
        return _Planned(RequestResult(i, tenant, "over_total" if over else "normal", "completions", False, 10, 4,
                                      over, None), {}, None, abort, 0.0)

    main = [planned(0, "a"), planned(1, "b", abort=1.0), planned(2, "b"), planned(3, "c", over=True),
            planned(4, "d"), planned(5, "a"), planned(6, "c", over=True), planned(7, "d", over=True)]
    before, after = split_for_kills(main, 0.25)
    assert sorted(p.result.index for p in before + after) == list(range(8))      # nothing lost or doubled
    assert [p.result.index for p in after][-2:] == [6, 7]                     # the tail still goes after
    answerable = {p.result.tenant for p in after if not p.result.over_length and p.abort_after_s is None}
    assert answerable == {"a", "b", "d"}       # c has no in-context request; b's aborting one does not count
    assert [p.result.index for p in before] == [0, 1, 3]   # each tenant's latest answerable one moved
    assert split_for_kills(main, 0.0)[1] and len(split_for_kills(main, 1.0)[0]) == 0
