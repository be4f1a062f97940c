"""Hand the heap memory that malloc holds free back to the operating system, when the engine goes idle.

A step allocates and frees many buffers of many sizes (activations, logits, sampling tensors) on the engine
thread, and requests allocate text and token lists on others; glibc's malloc keeps what is freed in per-thread
arenas for reuse, and fragmentation leaves much of it there, so a server's resident memory creeps up after
each burst of traffic though nothing leaks. `malloc_trim` returns the free pages of every arena; it is called
when the engine has nothing left to run, where the few milliseconds it takes delay no step. Elsewhere than
glibc it does not exist, and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
