"""Fixtures for the formal-model tests: the repo root on sys.path, and spin + gcc."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def spin_tools() -> dict[str, str]:
    """Paths of spin and gcc. Without them the model checks skip on a developer
    machine and fail in CI (where the CI variable is set): a proof that silently
    does not run proves nothing."""
    tools = {name: shutil.which(name) for name in ("spin", "gcc")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        msg = (f"{' and '.join(missing)} not installed: the Promela model in spec/ cannot be "
               "checked (apt-get install spin gcc)")
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI is set, so this is a failure", pytrace=False)
        pytest.skip(msg + "; set CI to make this a failure")
    return tools  # type: ignore[return-value]
