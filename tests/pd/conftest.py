"""One default PD cluster (tests/pd/pd_cluster.py) shared by the modules that need nothing
else: each start of three processes costs 10-20 s on the CI machine. A module takes it
through `shared_cluster`, which hands it over settled (no fault armed, both nodes back at
baseline), so what one module did cannot leak into the next one's checks. It is stopped
after the last test that uses it, not at the end of the session; the modules that use it are
named test_cluster*.py so that they run one after another."""
from __future__ import annotations

import pytest
from pd_cluster import Cluster

_USERS = "shared_cluster"
_last_user: list[str] = []
_running: list[Cluster] = []


@pytest.hookimpl(trylast=True)   # after any plugin that reorders the tests
def pytest_collection_modifyitems(items):
    users = [item.nodeid for item in items if _USERS in getattr(item, "fixturenames", ())]
    _last_user[:] = users[-1:]


def _stop() -> None:
    while _running:
        _running.pop().stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is None or item.nodeid in _last_user:
        _stop()


def pytest_sessionfinish(session):
    _stop()   # also when the run was interrupted


@pytest.fixture(scope="session")
def make_llm(make_llm_bf16):
    """Single-node references in the nodes' dtype (NODE_ARGS: bfloat16, the default)."""
    return make_llm_bf16


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory) -> Cluster:
    """The running shared cluster (started by the first module that asks), settled."""
    if not _running:
        _running.append(Cluster(tmp_path_factory.mktemp("pd-shared")).start_all())
    c = _running[0]
    c.clear_faults()
    c.wait_ready(120)
    c.wait_quiet(30)
    return c
