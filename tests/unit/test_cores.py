"""kvfence/cores.py: the threads a process starts by default follow a container's CPU quota as
well as its affinity (a 4-CPU pod on a 64-core node ran 64 threads on 4 cores' time)."""
from __future__ import annotations

import os

import pytest

from kvfence.cores import quota_cores, usable_cores
from kvfence.engine.config import EngineConfig


def cgroup(tmp_path, **files):
    for name, text in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "250000 100000\n"}, 3),                # v2: 2.5 CPUs, rounded up
    ({"cpu.max": "100000 100000\n"}, 1),
    ({"cpu.max": "max 100000\n"}, None),                # v2: no limit
    ({"cpu__cpu.cfs_quota_us": "400000\n", "cpu__cpu.cfs_period_us": "100000\n"}, 4),   # v1
    ({"cpu__cpu.cfs_quota_us": "-1\n", "cpu__cpu.cfs_period_us": "100000\n"}, None),    # v1: no limit
    ({"cpu.max": "garbled"}, None),
    ({}, None),                                          # no cgroup files (not Linux, not mounted)
])
def test_the_quota_in_whole_cores(tmp_path, files, cores):
    assert quota_cores(cgroup(tmp_path, **files)) == cores


def test_the_usable_cores_are_the_affinity_capped_by_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cores(cgroup(tmp_path / "a", **{"cpu.max": "400000 100000"})) == 4
    assert usable_cores(cgroup(tmp_path / "b", **{"cpu.max": "max 100000"})) == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert usable_cores(cgroup(tmp_path / "c", **{"cpu.max": "400000 100000"})) == 2


def test_the_engine_starts_as_many_threads_as_the_quota_allows(monkeypatch):
    import kvfence.cores as cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(cores, "quota_cores", lambda root=cores.CGROUP: 4)
    assert EngineConfig().threads() == 4
    assert EngineConfig(num_threads=2).threads() == 2   # --threads wins
