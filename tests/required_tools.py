"""A program a test needs. Without it the test skips on a developer's machine and fails in CI
(where the CI variable is set): a check that silently does not run checks nothing."""
from __future__ import annotations

import os
import shutil

import pytest


def tool_or_skip(*names: str, purpose: str, install: str) -> str:
    """The path of the first of `names` found on PATH."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    msg = f"no {names[0]} ({install}): {purpose} cannot run"
    if os.environ.get("CI"):
        pytest.fail(msg + "; CI is set, so this is a failure", pytrace=False)
    pytest.skip(msg + "; set CI to make this a failure")
