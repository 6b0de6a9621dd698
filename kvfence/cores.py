"""How many cores this process may use: its CPU affinity (taskset, a cpuset), capped by a CPU
quota (a container's --cpus, a Kubernetes CPU limit), which affinity does not show. A pod
limited to 4 CPUs on a 64-core node sees 64 cores: 64 threads then share 4 cores' time and
wait for each other at every parallel region. The quota is read where a container sees its
own (cgroup v2's cpu.max, v1's cfs_quota_us at the usual mount), as joblib's loky does."""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None


def quota_cores(root: Path = CGROUP) -> int | None:
    """The CPU quota as whole cores (rounded up), or None where there is none."""
    v2 = _read(root / "cpu.max")             # "QUOTA PERIOD", or "max PERIOD" for none
    if v2 is not None:
        words = v2
    else:
        quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
        if not quota or not period:
            return None
        words = quota[:1] + period[:1]       # v1: a quota of -1 for none
    try:
        q, p = int(words[0]), int(words[1])
    except (ValueError, IndexError):
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def usable_cores(root: Path = CGROUP) -> int:
    affinity = len(os.sched_getaffinity(0))
    quota = quota_cores(root)
    return affinity if quota is None else min(affinity, quota)
