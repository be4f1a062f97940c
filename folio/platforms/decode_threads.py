"""The decode threads: folio's kernels run on threads of folio's own during steps of one token.

A batch-1 decode step reads every weight once and, between the linear layers, spends 2-3 ms in Python, norms,
rotary, attention and sampling, with memory idle. OpenMP's worker waits out those gaps in a barrier; the decode
threads (folio/csrc/cpu_decode_threads.cpp) prefetch the first blocks of their share of the next layer's weight
meanwhile, so that the layer starts partly from cache. The kernels parallelise through folio/csrc/parallel.h,
which sends their loops to these threads while they are on and to OpenMP otherwise.

They are on for steps of at most DECODE_TOKENS tokens, with torch's own thread count set to one meanwhile (an
OpenMP worker spinning on the cores the decode threads spin on would take turns with them at the scheduler's
pace, milliseconds); other steps run on OpenMP as before. Without work they spin for 100 us, then sleep (the main
thread, waiting for their parts, 50 us). Without the kernel (no compiler, FOLIO_DISABLE_CPU_KERNELS=1) or with
one thread, or where OpenMP bound the main thread to fewer cores than the threads, every step runs on OpenMP.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_decode_threads", CSRC / "cpu_decode_threads.cpp", what="CPU decode threads",
                   fallback="every step runs its kernels on OpenMP")
# Steps of this many tokens or fewer run on the decode threads: batch-1 decode, which reads all of the weights
# for one token. Larger steps keep OpenMP, whose threads torch's own operators (sampling, GEMMs) use too.
DECODE_TOKENS = 1


def entry_points() -> Optional[Any]:
    """The capsule the kernels' parallel.h calls through (folio.csrc_build hands it to each extension)."""
    ext = KERNEL.load()
    return None if ext is None else ext.capsule()


@contextmanager
def threads_for_step(num_tokens: int) -> Iterator[None]:
    """Within: the decode threads run the kernels of a step of num_tokens <= DECODE_TOKENS tokens, with torch's
    thread count at one; OpenMP as before for larger steps (and where the decode threads cannot run). The
    thread count is set back after every step (0.2 us), so that nothing outside a step sees it changed."""
    threads = torch.get_num_threads()
    # workers start with this thread's cores: where OpenMP bound it to fewer (OMP_PLACES, OMP_PROC_BIND), they
    # would share them with it (batch-1 decode 2.3x slower), and OpenMP's own workers, bound apart, serve instead
    spread = threads > 1 and len(os.sched_getaffinity(0)) >= threads
    ext = KERNEL.load() if num_tokens <= DECODE_TOKENS and spread else None
    if ext is None:
        yield
        return
    ext.set_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        ext.set_threads(0)
