"""What the image (deploy/Dockerfile) gives its processes, for the tests that run them as it would
without Docker: its ENV settings (PATH aside) and its user."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from required_tools import tool_or_skip

ROOT = Path(__file__).resolve().parents[1]


def _dockerfile() -> str:
    return re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "Dockerfile").read_text())


def given_to_user() -> set[str]:
    """The folders the Dockerfile's RUN instructions chown to its user."""
    _, uid, gid = image()
    return {path for line in re.findall(r"^RUN (.+)$", _dockerfile(), re.M)
            for paths in re.findall(rf"chown -R {uid}:{gid} ([^&;]+)", line) for path in paths.split()}


def image() -> tuple[dict[str, str], int, int]:
    """The Dockerfile's ENV (PATH aside) and its USER's uid and gid."""
    text = _dockerfile()
    env = {k: v for line in re.findall(r"^ENV (.+)$", text, re.M) for k, v in re.findall(r"(\w+)=(\S+)", line)
           if k != "PATH"}
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user is not None
    return env, int(user[1]), int(user[2])


def become_image_user_or_skip() -> None:
    """Skip without root (as the network namespace tests do), or where this checkout's Python is out
    of the image user's reach (a checkout under a 0700 home); without setpriv, fail in CI."""
    if os.geteuid() != 0:
        pytest.skip("running as the image's user takes root")
    tool_or_skip("setpriv", purpose="running a process as the image's user", install="Debian package util-linux")
    r = subprocess.run(as_image_user([sys.executable, "-c", "import kvfence.cli"]), capture_output=True, text=True,
                       timeout=60, env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"the image's user cannot run this checkout's Python ({last}): a folder above it is "
                    f"closed to other users")


def open_folder() -> Path:
    """A temporary folder another user can reach (pytest's own sit under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="kvfence-image-"))
    path.chmod(0o755)
    return path


def image_env(base: Path) -> dict[str, str]:
    """The environment a process of the image starts with, and no home, as 65534 has none. Each
    folder its ENV names is made under `base` as the build leaves it: its user's where a RUN
    chowns it to them, else root's (so a Dockerfile that forgets the chown fails the tests)."""
    env, uid, gid = image()
    mine = given_to_user()
    out = {"PATH": os.environ["PATH"], "HOME": "/nonexistent"}
    for name, value in env.items():
        if value.startswith("/"):
            folder = base / name.lower()
            folder.mkdir(exist_ok=True)
            if value in mine:
                os.chown(folder, uid, gid)
            value = str(folder)
        out[name] = value
    return out


def as_image_user(argv: list[str], groups: tuple[int, ...] = ()) -> list[str]:
    """argv run as the image's user (and `groups`, as a pod's fsGroup adds), sent SIGTERM if the
    test process dies (setpriv sets it after the change of user, which clears an earlier one)."""
    _, uid, gid = image()
    extra = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *extra, "--pdeathsig", "TERM", *argv]
