"""The schema checker's worker process: llguidance's verdict on a schema, and past the
deadline a refusal, the worker killed and a new one for the next schema."""
from __future__ import annotations

import json

import pytest

from kvfence.engine.schema_check import SchemaChecker, SchemaTooCostly
from kvfence.pd.router import load_router_tokenizer


@pytest.fixture(scope="module")
def checker():
    c = SchemaChecker(load_router_tokenizer(None), deadline_s=0.5)   # the bundled model's tokenizer
    yield c
    c.close()


def test_a_schema_that_compiles_passes_and_one_that_cannot_is_named(checker):
    assert checker.check(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})) is None
    assert "look-around" in checker.check(json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    assert "larger than" in checker.check(json.dumps({"enum": ["y" * (64 << 10)]}))


@pytest.mark.parametrize("costly", [
    {"type": "integer", "multipleOf": 999983},    # the matcher's build (~6 s)
    {"allOf": [{"type": "string", "pattern": f"(.*{c}.*){{5}}"} for c in "abcdefghijklmnopqrst"]},   # validation
])
def test_past_the_deadline_the_worker_is_stopped_and_the_next_schema_served(checker, costly):
    assert checker.check(json.dumps({"type": "string"})) is None   # a worker runs (even when run alone)
    killed = checker.killed
    first = checker._proc
    with pytest.raises(SchemaTooCostly, match="longer than 0.5 s"):
        checker.check(json.dumps(costly))
    assert checker.killed == killed + 1 and first is not None and first.poll() is not None   # no longer running
    assert checker.check(json.dumps({"type": "string"})) is None
    assert checker._proc is not first


def test_a_call_may_have_a_shorter_deadline_but_never_a_longer_one(checker):
    with pytest.raises(SchemaTooCostly, match="longer than 0.2 s"):
        checker.check(json.dumps({"type": "integer", "multipleOf": 999983}), deadline_s=0.2)
    with pytest.raises(SchemaTooCostly, match="no time"):
        checker.check(json.dumps({"type": "string"}), deadline_s=0)
    with pytest.raises(SchemaTooCostly, match="longer than 0.5 s"):
        checker.check(json.dumps({"type": "integer", "multipleOf": 999983}), deadline_s=60)


def test_a_stopped_server_builds_no_checker_again():
    """A check still queued when the server stops must not start a worker that outlives it."""
    from kvfence.server.app import ServerState
    from kvfence.server.tenants import TenantRegistry

    class Backend:   # the checker needs only the tokenizer and the vocabulary size
        tokenizer = load_router_tokenizer(None)
        facts = {"vocab_size": None}

    used = ServerState(Backend(), TenantRegistry.single())  # type: ignore[arg-type]
    first = used.schema_checker
    assert first.check(json.dumps({"type": "string"})) is None
    used.close()
    assert first._proc is None or first._proc.poll() is not None
    with pytest.raises(RuntimeError):
        used.schema_checker.check(json.dumps({"type": "string"}))
    unused = ServerState(Backend(), TenantRegistry.single())  # type: ignore[arg-type]
    unused.close()   # before any schema came: the lazy property must not start a worker now
    with pytest.raises(RuntimeError, match="stopping"):
        _ = unused.schema_checker
    assert unused._schema_checker is None
