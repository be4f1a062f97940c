"""What a cgroup (a container's limits) lets this process use: CPUs by its CPU quota, and memory below its limit.

A container limited to 2 CPUs and 8 GB on a 64-core, 512 GB host still sees all 64 cores in its affinity mask and
the host's free memory in /proc/meminfo. One OpenMP thread per core would run 64 threads on 2 CPUs' worth of time,
every parallel region waiting for the threads the quota throttled; and a KV cache sized from the host's memory
grows, under load, past the limit, where the kernel kills the process. Kubernetes' limits and `docker run --cpus
--memory` set such cgroups. Read here, for the process's cgroup and every one above it (any of them may hold the
limit; in a container with its own cgroup namespace, the mount's root), from the files the kernel mounts:
- CPU: cgroup v2 `cpu.max` ("200000 100000", "max 100000" for none); v1 `cpu.cfs_quota_us` (-1 for none) over
  `cpu.cfs_period_us`;
- memory: v2 `memory.max` ("max" for none) less `memory.current`; v1 `memory.limit_in_bytes` (about 2^63 for
  none) less `memory.usage_in_bytes`. The page cache's inactive files (`memory.stat`), which the kernel reclaims
  before it kills, count as free, as Kubernetes' working set counts them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
NO_MEMORY_LIMIT = 1 << 62  # v1 reports "none" as the largest page-aligned 64-bit value


def cpu_limit(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> Optional[int]:
    """The fewest CPUs any quota on this process's cgroups allows (a fraction rounded up), None without one."""
    return _smallest(root, membership, "cpu", _v2_cpus, _v1_cpus)


def memory_headroom(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> Optional[int]:
    """The fewest bytes any memory limit on this process's cgroups leaves free, None without one."""
    return _smallest(root, membership, "memory", _v2_memory, _v1_memory)


Reader = Callable[[Path], Optional[int]]


def _smallest(root: Path, membership: Path, controller: str, v2: Reader, v1: Reader) -> Optional[int]:
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    values = []
    for line in lines:  # "hierarchy-id:controllers:path"
        fields = line.split(":", 2)
        if len(fields) == 3:
            values.extend(_values(root, controller, fields[1], fields[2], v2, v1))
    return min(values) if values else None


def _values(root: Path, controller: str, controllers: str, path: str, v2: Reader, v1: Reader) -> Iterator[int]:
    """A membership line's cgroup's value and those of the cgroups above it (cgroup v2: no controllers listed)."""
    if controllers and controller not in controllers.split(","):
        return
    mounts = [root] if not controllers else list(dict.fromkeys([root / controllers, root / controller]))
    for mount in mounts:
        folder = mount / path.lstrip("/")
        if not folder.is_dir():
            folder = mount
        while True:
            value = (v1 if controllers else v2)(folder)
            if value is not None:
                yield value
            if folder == mount:
                break
            folder = folder.parent


def _read(folder: Path, name: str) -> Optional[str]:
    try:
        return (folder / name).read_text().strip()
    except OSError:
        return None


def _number(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _cpus(quota: Optional[int], period: Optional[int]) -> Optional[int]:
    """CPUs for a quota over its period, rounded up; None for none ("max", -1) or what is not a number."""
    return max(1, math.ceil(quota / period)) if quota and period and quota > 0 and period > 0 else None


def _v2_cpus(folder: Path) -> Optional[int]:
    fields = (_read(folder, "cpu.max") or "").split()
    return _cpus(_number(fields[0]), _number(fields[1])) if len(fields) >= 2 else None


def _v1_cpus(folder: Path) -> Optional[int]:
    return _cpus(_number(_read(folder, "cpu.cfs_quota_us")), _number(_read(folder, "cpu.cfs_period_us")))


def _inactive_file(folder: Path, key: str) -> int:
    for line in (_read(folder, "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _number(value) or 0
    return 0


def _headroom(limit: Optional[int], usage: Optional[int], inactive: int) -> Optional[int]:
    if limit is None or usage is None or limit >= NO_MEMORY_LIMIT:
        return None
    return max(0, limit - max(0, usage - inactive))


def _v2_memory(folder: Path) -> Optional[int]:
    return _headroom(_number(_read(folder, "memory.max")), _number(_read(folder, "memory.current")),
                     _inactive_file(folder, "inactive_file"))


def _v1_memory(folder: Path) -> Optional[int]:
    return _headroom(_number(_read(folder, "memory.limit_in_bytes")), _number(_read(folder, "memory.usage_in_bytes")),
                     _inactive_file(folder, "total_inactive_file"))
