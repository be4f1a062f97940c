"""oneDNN's primitive caches bounded, before their first use, so that resident memory stops growing with use.

A linear layer on a weight oneDNN packed (folio.models.dense_linear) runs a oneDNN primitive made for the
batch's number of rows: its descriptor and JIT-compiled code, about 0.3-0.6 MiB whatever the weight's size. Two
caches keep every one made: oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and PyTorch's ideep layer's
(LRU_CACHE_CAPACITY), 1024 entries each by default. A server sees a new row count in most steps (prefill chunks,
decode batches past the small-batch kernel's limit), times each weight shape, so its memory grew by hundreds of
MiB before the caches filled: five weight shapes at 1000 row counts, float32 on 2 cores of a Zen 3 EPYC, grew
672 MiB with the defaults and 58 MiB with 64 entries each, in no more time (a primitive is made in well under a
millisecond there; a step's few shapes stay cached).

Both libraries read their capacity from the environment when they first make a primitive, so setting it as folio
is imported covers every primitive of the process unless one was made before.
"""

from __future__ import annotations

import os

CAPACITY = "64"
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_default_capacity() -> list[str]:
    """Each variable set to CAPACITY unless the user set it; the ones it set."""
    chosen = [name for name in VARIABLES if name not in os.environ]
    for name in chosen:
        os.environ[name] = CAPACITY
    return chosen
