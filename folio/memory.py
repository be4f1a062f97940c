"""Memory the machine can give folio: what is available now (MemAvailable), the budget behind the KV cache's
default size and behind extra weight copies for fast small batches; and how freed memory is kept.

glibc hands every allocation over its mmap threshold (at most 32 MiB, adjusted as blocks are freed) its own
mapping and unmaps it on free, and trims the heap's free top back to the kernel. A step's large
activations (a 2048-token chunk's [2048, 9728] gate/up output is 40 MB) are allocated and freed every
layer, so every layer faulted ~1 GB of fresh zeroed pages in again: 258k page faults and ~14% of a Qwen2-0.5B
prefill step on two cores. `keep_freed_memory()` raises the threshold to 1 GiB and turns trimming off,
so freed blocks stay in the heap for the next layer and step (12 faults per step); the process keeps its
high-water mark instead of returning it, which a serving engine reuses anyway. This is what the usual
advice to run CPU inference under tcmalloc or jemalloc achieves, without a preloaded library.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
# the user's own glibc malloc settings win
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def keep_freed_memory() -> bool:
    """Keep freed memory in the process for reuse (see above); False where glibc's mallopt is not there or the
    environment already sets malloc tunables."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    logger.debug("malloc: mmap threshold %d, no trimming: %s", MMAP_THRESHOLD_BYTES, ok)
    return ok
