"""Memory the machine can give folio now (MemAvailable): the budget behind the KV cache's default size and
behind keeping extra weight copies for fast small batches."""

from __future__ import annotations


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
