"""Fixtures for the formal-model tests: the repo root on sys.path, and spin + gcc; and the
model checks started as soon as the tests are collected.

The checks take minutes of CPU (single-threaded searches, spec/README.md), while a run of the
whole suite leaves the cores idle close to half the time (vmstat over a clean-clone .ci/run
on a 2-core development machine like CI's: 46% idle), waiting on servers that start, streams
and timeouts. Started at once at nice 19, the searches use that idle time and yield the cores
to any test that wants them; by the time tests/spec runs they are done or nearly so."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from required_tools import tool_or_skip

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def spin_tools() -> dict[str, str]:
    """Paths of spin and gcc (a proof that silently does not run proves nothing: a failure in CI)."""
    return {name: tool_or_skip(name, purpose="the Promela model in spec/ (checked by spin, compiled by gcc)",
                               install="apt-get install spin gcc") for name in ("spin", "gcc")}


def pytest_collection_finish(session):
    """If test_handoff_model.py is to run and spin and gcc are here, start its campaign now."""
    if session.config.option.collectonly:
        return
    if not any(item.nodeid.split("::")[0].endswith("spec/test_handoff_model.py") for item in session.items):
        return
    if not all(shutil.which(name) for name in ("spin", "gcc")):
        return   # the spin_tools fixture says what is missing
    from promela_tools import start_in_background

    start_in_background()


def pytest_sessionfinish(session):
    from promela_tools import stop_background

    stop_background()   # kills what still runs, removes its directories
