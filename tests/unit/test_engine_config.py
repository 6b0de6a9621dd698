"""The engine's settings are checked when they are made, before a model loads: a value that
would make the engine spin, stall or fail later is refused with its name."""
from __future__ import annotations

import dataclasses

import pytest

from kvfence.engine.config import EngineConfig


@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 0),               # found in review: the scheduler ran empty steps forever
    ("max_num_batched_tokens", 0),     # the same, with no token budget
    ("max_waiting", 0),
    ("page_size", 0), ("page_size", 15),
    ("prefill_tokens_while_decoding", -1),
    ("decode_step_target_ms", float("nan")), ("decode_step_target_ms", -5.0), ("decode_step_target_ms", float("inf")),
    ("max_model_len", 0),
    ("num_threads", 0),
    ("kv_memory_fraction", 0.0), ("kv_memory_fraction", float("nan")),
    ("scrub", "random"),
    ("dtype", "int4"),
    ("tenant_waiting_share", 0.0), ("tenant_waiting_share", 1.5), ("tenant_waiting_share", float("nan")),
    ("kv_cache_memory", "64XB"),
])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field.replace("num_threads", "threads")):
        EngineConfig(**{field: value})


def test_defaults_and_edge_values_are_accepted():
    base = EngineConfig()
    for change in ({"max_num_batched_tokens": 7}, {"prefill_tokens_while_decoding": 0},
                   {"decode_step_target_ms": 0.0}, {"kv_cache_memory": "64MiB", "kv_memory_fraction": 0.0},
                   {"page_size": 2}, {"scrub": "poison"}, {"tenant_waiting_share": 1.0}):
        assert dataclasses.replace(base, **change)
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(base, max_num_seqs=0)     # replace() checks too


def test_the_command_line_says_what_is_wrong_before_loading(capsys, tmp_path):
    from kvfence import incidents
    from kvfence.cli import main

    try:
        assert main(["serve", "--max-num-seqs", "0", "--incident-log", str(tmp_path / "i.jsonl")]) == 2
    finally:
        incidents.close_log()
    assert "max_num_seqs must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("max_waiting,share,places", [(1024, 0.5, 512), (4, 0.5, 2), (1, 0.5, 1), (3, 0.5, 1),
                                                      (16, 1.0, 16)])
def test_a_tenants_waiting_places_are_its_share_and_at_least_one(max_waiting, share, places):
    """One number for the engine's load check and the server's n bound (app.py)."""
    assert EngineConfig(max_waiting=max_waiting, tenant_waiting_share=share).tenant_waiting_places == places
