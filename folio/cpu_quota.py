"""The CPUs that a cgroup's CPU quota (a container's CPU limit) lets this process use.

A container limited to 2 CPUs on a 64-core host still sees all 64 cores in its affinity mask. One OpenMP thread
for each would run 64 threads on 2 CPUs' worth of time, and every parallel region would wait for the threads the
quota throttled. Kubernetes' CPU limits and `docker run --cpus` set such quotas, as the CFS quota over its
period: cgroup v2 `cpu.max` ("200000 100000", or "max 100000" for none), v1 `cpu.cfs_quota_us` (-1 for none)
over `cpu.cfs_period_us`. A quota on any cgroup above this process's applies too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def limit(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> Optional[int]:
    """The fewest CPUs any quota on this process's cgroups allows (a fraction rounded up), None without one or
    where none can be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = [quota for line in lines if line.count(":") >= 2 for quota in _quotas(root, *line.split(":", 2)[1:])]
    return min(quotas) if quotas else None


def _quotas(root: Path, controllers: str, path: str) -> Iterator[int]:
    """The quotas of a membership line's cgroup and of those above it (cgroup v2: no controllers listed)."""
    if controllers and "cpu" not in controllers.split(","):
        return
    mounts = [root] if not controllers else list(dict.fromkeys([root / controllers, root / "cpu"]))
    for mount in mounts:
        # the cgroup's own folder, or (in a container with its own cgroup namespace) the mount itself
        folder = mount / path.lstrip("/")
        if not folder.is_dir():
            folder = mount
        while True:
            quota = _v2_quota(folder) if not controllers else _v1_quota(folder)
            if quota is not None:
                yield quota
            if folder == mount:
                break
            folder = folder.parent


def _v2_quota(folder: Path) -> Optional[int]:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return _cpus(quota, period)


def _v1_quota(folder: Path) -> Optional[int]:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _cpus(quota, period)


def _cpus(quota: str, period: str) -> Optional[int]:
    """CPUs for a quota over its period, rounded up; None for none ("max", -1) or what is not a number."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None
