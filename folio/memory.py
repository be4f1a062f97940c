"""Memory the machine can give folio: what is available now (MemAvailable, and no more than a container's memory
limit leaves: folio.cgroup_limits), the budget behind the KV cache's default size; and how freed memory is kept,
and handed back once after loading.

glibc hands every allocation over its mmap threshold (at most 32 MiB, adjusted as blocks are freed) its own
mapping and unmaps it on free, and trims the heap's free top back to the kernel. A step's large
activations (a 2048-token chunk's [2048, 9728] gate/up output is 40 MB) are allocated and freed every
layer, so every layer faulted ~1 GB of fresh zeroed pages in again: 258k page faults and ~14% of a Qwen2-0.5B
prefill step on two cores. `keep_freed_memory()` raises the threshold to 1 GiB and turns trimming off,
so freed blocks stay in the heap for the next layer and step (12 faults per step); the process keeps its
high-water mark instead of returning it, which a serving engine reuses anyway. This is what the usual
advice to run CPU inference under tcmalloc or jemalloc achieves, without a preloaded library.

The KV cache is the other way round: its budget (4 GiB by default) is mostly never written by a small
workload, so `zeros_on_demand` gives it a private anonymous mapping of its own. The kernel hands out a zeroed
page at the first write to it (reads of untouched pages see the shared zero page), so resident memory grows
with the blocks actually written, and never-written slots still read as zeros. A heap allocation would not
do: with the threshold above, a cache-sized `torch.empty` comes from the heap and may hold freed garbage
(NaN), and `torch.zeros` writes, so makes resident, every page of the budget at start.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import multiprocessing
import os
import resource

import torch

from folio import cgroup_limits

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
# the user's own glibc malloc settings win
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def available_memory_bytes() -> int:
    """The machine's MemAvailable, or less where a cgroup's memory limit leaves less (a container's: /proc/meminfo
    shows the host's memory)."""
    headroom = cgroup_limits.memory_headroom()
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return available if headroom is None else min(available, headroom)
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far, plus each live worker process's own peak (the tensor-parallel
    ranks of folio.executor.multiproc; Linux reports ru_maxrss and VmHWM in KiB)."""
    total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
        except OSError:  # it ended meanwhile
            pass
    return total


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


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim, which also releases free pages inside
    the heap): once, after the weights are loaded and processed. Their load-time forms (a bf16 layer's plain
    weight once oneDNN has its packed copy, an int8 layer's own copy once oneDNN's serves every batch) are freed
    then, and with trimming off (`keep_freed_memory`) they stayed resident: W1 in int8 kept 0.4-0.7 GB of them.
    False where glibc's malloc_trim is not there."""
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages become resident only when first written (see above); the mapping is
    unmapped when the tensor and its views are gone."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
