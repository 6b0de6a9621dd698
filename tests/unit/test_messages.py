"""The typed internal messages: exact types, ranges, unknown fields, NaN, each error naming
its field; and a round trip through JSON for every definition."""
from __future__ import annotations

import math

import pytest

from kvfence.engine.params import SamplingParams
from kvfence.pd.manifest import ManifestError, parse_handoff
from kvfence.pd.messages import (
    AbortBody,
    AdmittedEvent,
    DecodeBody,
    FailedEvent,
    ForgetTenantsBody,
    Handoff,
    Manifest,
    MessageError,
    PrefillBody,
    ProgressEvent,
    RejectedEvent,
    TransferSource,
    WaitEvent,
    WireParams,
    event_line,
    parse_event,
)


def manifest(**over) -> dict:
    d = dict(request_id="r1", tenant="acme", token_count=39, page_count=3, page_size=16, epochs=[1, 2, 3],
             fingerprint="fp", layout="layout", boot_id="b" * 32, seal_salt="ab" * 16, seal_key="cd" * 8,
             slot_bytes=1024, slots=[4, 5, 6], lease_deadline=1e9)
    d.update(over)
    return d


def test_manifest_round_trip():
    m = Manifest.from_json(manifest())
    assert Manifest.from_json(m.to_json()) == m and Manifest.from_json(m.dumps()) == m
    src = TransferSource(session="127.0.0.1:1234", base=1 << 40, boot_id="b" * 32)
    assert src.row_addresses(m) == [(1 << 40) + s * 1024 for s in (4, 5, 6)]


@pytest.mark.parametrize("field,value", [
    ("token_count", 39.0), ("token_count", "39"), ("token_count", True), ("token_count", -1),
    ("page_count", 3.0), ("lease_deadline", "x"), ("lease_deadline", math.nan), ("lease_deadline", math.inf),
    ("slots", [4, 5, "6"]), ("epochs", [1, 2, 3.5]), ("seal_salt", "zz" * 16), ("seal_salt", "ab"),
    ("seal_key", "CD" * 8), ("seal_key", "cd" * 9), ("seal_key", 7),
    ("request_id", ""), ("request_id", "x" * 129), ("tenant", None), ("boot_id", 7),
])
def test_manifest_wrong_type_or_range_names_the_field(field, value):
    with pytest.raises(MessageError, match=field):
        Manifest.from_json(manifest(**{field: value}))
    src = {"session": "s:1", "base": 0, "boot_id": "b" * 32}
    with pytest.raises(ManifestError, match=field):   # what decode's admission raises (a 400 / refusal)
        parse_handoff({"manifest": manifest(**{field: value}), "source": src})


def test_manifest_unknown_and_missing_fields_refused():
    with pytest.raises(MessageError, match="session"):   # a manifest names no address to pull from
        Manifest.from_json(manifest(session="evil:1"))
    d = manifest()
    del d["boot_id"]
    with pytest.raises(MessageError, match="boot_id"):
        Manifest.from_json(d)


def test_manifest_counts_must_agree():
    with pytest.raises(MessageError, match="3 slots and 3 epochs for 4 pages"):
        Manifest.from_json(manifest(page_count=4))


def test_nan_in_raw_json_refused():
    raw = Manifest.from_json(manifest()).dumps().replace(b'"lease_deadline":1000000000.0', b'"lease_deadline":NaN')
    with pytest.raises(MessageError, match="lease_deadline"):
        Manifest.from_json(raw)


def test_params_round_trip_and_checks():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9, stop=["x"], logprobs=2)
    assert WireParams.from_json(WireParams.of(p).to_json()).to_params() == p
    with pytest.raises(MessageError, match="temperature"):
        WireParams.from_json({"temperature": "hot"})
    with pytest.raises(MessageError, match="max_tokens"):
        WireParams.from_json({"max_tokens": 0})
    with pytest.raises(MessageError, match="beam_width"):
        WireParams.from_json({"beam_width": 4})
    # the API's floor holds on the wire too: a node's sampler would otherwise get NaN
    with pytest.raises(MessageError, match="repetition_penalty"):
        WireParams.from_json({"repetition_penalty": 1e-300})


def test_bodies():
    h = Handoff(manifest=Manifest.from_json(manifest()),
                source=TransferSource(session="127.0.0.1:9", base=4096, boot_id="b" * 32))
    body = DecodeBody(request_id="r1", tenant="acme", prompt_ids=[1, 2, 3], params=WireParams(), handoff=h)
    assert DecodeBody.from_json(body.dumps()) == body
    with pytest.raises(MessageError, match="prompt_ids"):
        PrefillBody.from_json({"request_id": "r", "tenant": "t", "prompt_ids": [], "params": {}})
    with pytest.raises(MessageError, match="prompt_ids.1"):
        PrefillBody.from_json({"request_id": "r", "tenant": "t", "prompt_ids": [1, -2], "params": {}})
    with pytest.raises(MessageError, match="reader_stopped"):
        AbortBody.from_json({"request_id": "r", "reader_stopped": "yes"})


@pytest.mark.parametrize("field, value", [("tenant", "a\0router:x"), ("tenant", "public:docs"), ("tenant", "a" * 65),
                                          ("public_prefix_scope", "docs\0"), ("scope", {"router": "r\0x", "epoch": 0}),
                                          ("scope", {"router": "", "epoch": 0})])
def test_names_in_a_nodes_cache_scope_keys_are_held_to_the_tenants_files_rule(field, value):
    """A node builds its cache-scope keys from the tenant, the public scope and the router id
    (ledger.scope_name, NUL-marked parts): none may hold what the tenants file refuses, so no
    two (router, tenant, scope) triples can meet in one key (found in review)."""
    body = {"request_id": "r", "tenant": "acme", "prompt_ids": [1, 2], "params": {},
            "scope": {"router": "0f" * 16, "epoch": 3}}
    PrefillBody.from_json(body)
    with pytest.raises(MessageError, match=field):
        PrefillBody.from_json({**body, field: value})
    with pytest.raises(MessageError, match="tenants"):
        ForgetTenantsBody.from_json({"tenants": ["ok", "not ok"]})


def test_events_round_trip():
    m = Manifest.from_json(manifest())
    for ev in (WaitEvent(), AdmittedEvent(prompt_tokens=3, max_tokens=4),
               RejectedEvent(code="context_length_exceeded", message="too long", limit=10, prompt_tokens=9,
                             max_tokens=5),
               ProgressEvent(event="kv_held", finished=True, manifest=m),
               ProgressEvent(event="tokens", token_ids=[5], text="a"), FailedEvent(error="boom")):
        assert parse_event(event_line(ev)) == ev
    with pytest.raises(MessageError, match="event"):
        parse_event(b'{"event": "pwned"}')
    with pytest.raises(MessageError, match="token_ids"):
        parse_event(b'{"event": "tokens", "token_ids": [1.5]}')
