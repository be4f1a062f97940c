"""Where tensor-parallel ranks run on one machine: which cores each keeps to, and the port they meet at."""

from __future__ import annotations

import os
import socket


def _physical_core(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; (0, cpu) where the topology is not there."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def rank_cores(rank: int, size: int) -> list[int]:
    """The logical CPUs a rank's process keeps to: its share of the physical cores this process may use, taken
    in order of package (socket) and core, each with its hyperthread siblings, so that no two ranks share a core
    and a rank's cores sit together on one socket where they fit; none (no change) where there are fewer
    physical cores than ranks."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault(_physical_core(cpu), []).append(cpu)
    ordered = [cores[key] for key in sorted(cores)]
    share = len(ordered) // size
    return [cpu for core in ordered[rank * share:(rank + 1) * share] for cpu in core] if share else []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host now, where the ranks meet (torch.distributed's tcp:// rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
