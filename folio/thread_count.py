"""folio's default torch thread count: OMP_NUM_THREADS where set, else one thread per core the process could use
as it started (counted when folio is imported, before torch loads OpenMP), and no more than a cgroup's CPU quota
allows.

With OMP_PLACES or OMP_PROC_BIND set (common advice for CPU inference), GNU OpenMP binds the main thread to its
first place as it loads. From then on os.sched_getaffinity(0) reports that one core, and "one torch thread per
core the process may use" would be one thread in all: W1 on 2 cores of a Xeon took 25.6 s instead of 14.1, with
nothing said. folio's default thread count takes the set read before that. A program that imports torch before
folio gets OpenMP's own thread count where a binding variable is set.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from folio import cgroup_limits

logger = logging.getLogger(__name__)

BINDING_VARIABLES = ("OMP_PLACES", "OMP_PROC_BIND")

_AT_IMPORT: Optional[int] = None if "torch" in sys.modules else len(os.sched_getaffinity(0))


def default() -> int:
    """The first count of OMP_NUM_THREADS (a list gives nested levels' counts) where it is a positive number, as
    OpenMP reads it; else cores(), at most the CPUs a cgroup's quota allows (folio.cgroup_limits)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    quota = cgroup_limits.cpu_limit()
    return cores() if quota is None else min(cores(), quota)


def cores() -> int:
    """The cores this process could use when folio was imported, if that came before torch's OpenMP bound the
    main thread. Else those the main thread may use now; where a binding variable is set and OpenMP's own thread
    count (taken from the places before it bound the thread) is more, that count."""
    if _AT_IMPORT is not None:
        return _AT_IMPORT
    now = len(os.sched_getaffinity(0))
    bound = [name for name in BINDING_VARIABLES if os.environ.get(name, "false").lower() != "false"]
    if not bound:
        return now
    import torch  # loaded already: that is how the thread came to be bound

    threads = torch.get_num_threads()
    if threads <= now:
        return now
    logger.info("%s is set and torch was imported before folio, so OpenMP bound this thread to %d core(s) first: "
                "taking OpenMP's thread count, %d (num_threads, --num-threads, chooses another)",
                " and ".join(bound), now, threads)
    return threads
