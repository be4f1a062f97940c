"""folio's default thread count (folio.thread_count): OMP_NUM_THREADS where set; where OMP_PLACES or OMP_PROC_BIND
made OpenMP bind the main thread to one core as torch loaded, the cores counted as folio was imported, or OpenMP's
own count where torch came first; and the decode threads step aside for OpenMP's bound workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from folio.platforms import decode_threads

CORES = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(CORES < 2, reason="binding shows only with two cores or more")


def threads_after(imports: str, **env: str) -> tuple[int, int, str]:
    """(cores the main thread may use, folio's default thread count, stderr) in a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_PLACES", "OMP_PROC_BIND", "OMP_NUM_THREADS")}
    code = (f"{imports}; import os, torch; from folio.platforms import current_platform; "
            "current_platform().prepare_process(None); print(len(os.sched_getaffinity(0)), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    bound, threads = map(int, out.stdout.split())
    return bound, threads, out.stderr


def test_folio_imported_first_counts_the_cores_before_openmp_binds_the_thread():
    assert threads_after("import folio")[:2] == (CORES, CORES)
    # one thread per core, though this one is bound to the first, whatever torch's count was meanwhile
    bound, threads, _ = threads_after("import folio, torch; torch.set_num_threads(1)", OMP_PLACES="threads",
                                      OMP_PROC_BIND="close")
    assert bound == 1 and threads == CORES


def test_torch_imported_first_takes_openmps_own_count():
    bound, threads, err = threads_after("import torch, folio", OMP_PLACES="threads")
    assert bound == 1 and threads == CORES and "taking OpenMP's thread count" in err
    assert threads_after("import torch, folio", OMP_PROC_BIND="false")[:2] == (CORES, CORES)


def test_omp_num_threads_is_the_count_where_it_is_set():
    assert threads_after("import folio", OMP_NUM_THREADS="1")[1] == 1
    assert threads_after("import folio", OMP_NUM_THREADS="1,4")[1] == 1  # the outer level's
    assert threads_after("import folio", OMP_NUM_THREADS="none")[1] == CORES  # OpenMP ignores it too


def test_the_decode_threads_step_aside_where_the_main_thread_is_bound():
    """Their workers would start on the main thread's one core; OpenMP's, bound apart, run the step instead."""
    if decode_threads.KERNEL.load() is None:
        pytest.skip("the decode threads' kernel does not build here")
    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(2)
    try:
        with decode_threads.threads_for_step(1):
            assert decode_threads.KERNEL.load().threads() == 2 and torch.get_num_threads() == 1
        os.sched_setaffinity(0, {min(before_cpus)})
        with decode_threads.threads_for_step(1):
            assert decode_threads.KERNEL.load().threads() == 0 and torch.get_num_threads() == 2
    finally:
        os.sched_setaffinity(0, before_cpus)
        torch.set_num_threads(before_threads)
