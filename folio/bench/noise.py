"""How busy the rest of the machine was while something was timed (the performance study's `other_cores`).

Other people's work on a shared CPU slows a benchmark down by several times, silently. Measuring it costs two
reads of /proc: the CPU time all processes used (/proc/stat) minus this process's own (os.times, children
included), per second of wall time, in cores. About 0 means the figure is clean; 0.1 or more means it is not.
/proc/stat counts in clock ticks (10 ms), so only regions of a second or more give a meaningful figure.
"""

from __future__ import annotations

import multiprocessing
import os
import time

NOISY_CORES = 0.1


def _machine_busy_seconds() -> float:
    """CPU seconds every process has used since boot (all fields of the 'cpu' line but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of its children: those that ended (os.times) and the live worker
    processes (tensor-parallel ranks), from /proc."""
    t = os.times()
    live = 0
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            live += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
        except OSError:
            pass
    return t.user + t.system + t.children_user + t.children_system + live / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Started at construction; `cores()` reads how many cores other processes used since then, on average."""

    def __init__(self) -> None:
        self._wall, self._busy, self._own = time.perf_counter(), _machine_busy_seconds(), _own_seconds()

    def cores(self) -> float:
        wall = time.perf_counter() - self._wall
        other = (_machine_busy_seconds() - self._busy) - (_own_seconds() - self._own)
        return min(max(0.0, other / wall), float(os.cpu_count() or 1)) if wall > 0 else 0.0


def note(cores: float) -> str:
    """The report's line on it."""
    verdict = "clean" if cores < NOISY_CORES else "NOISY: slower than this machine can do, run again when it is quiet"
    return f"other processes kept {cores:.2f} cores busy meanwhile ({verdict})"
