"""How long OpenMP's threads spin at a barrier before they sleep, set before torch loads its OpenMP runtime.

folio's kernels give each thread a fixed share of an operator's work and join at the end of the parallel region.
A decode step runs hundreds of such regions. GNU OpenMP's threads poll up to GOMP_SPINCOUNT times at a barrier
(300000 by default) before they sleep. On cores shared with another busy process, the scheduler parks one of
folio's threads for a time slice while the other spins on, waiting for it.

Measured on 2 cores of an Emerald Rapids Xeon, 32 prompts of 256 tokens, 32 output tokens each:
- alone: 224 output tok/s;
- beside one busy-loop process, with the default spin count: 21 tok/s;
- beside it with 3000 polls: 117 tok/s, half the speed with half the cores (1000 polls: 119, 10000: 97,
  30000: 75).
W1 alone stayed within the noise: 526-546 tok/s with the default, 522-609 with 3000 polls, in runs alternating.
On that busy machine, vLLM's CPU build (Intel OpenMP, threads bound) ran 3.8x folio's default.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "3000"


def set_default_spin() -> bool:
    """GOMP_SPINCOUNT=SPIN_COUNT unless the user chose how OpenMP waits (GOMP_SPINCOUNT or OMP_WAIT_POLICY), or
    torch, and with it OpenMP, is already loaded (OpenMP reads its settings once, as it loads). Whether it set it."""
    if "torch" in sys.modules or any(name in os.environ for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
