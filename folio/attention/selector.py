"""Which attention backend a model runner gets.

`get_attention_backend()` returns the CPU paged-attention kernel (folio.attention.cpu_paged) when it builds
and loads, else the torch SDPA reference backend. FOLIO_ATTENTION_BACKEND=torch_sdpa|cpu_paged forces one;
a forced cpu_paged whose kernel cannot be built still falls back to torch_sdpa, with a warning, rather
than stopping the engine. FOLIO_DISABLE_CPU_KERNELS=1 skips the kernel build altogether.

The first call on a machine compiles the kernel (about 15 s on two cores, logged); later processes load it
from the build cache (see folio.attention.cpu_paged).
"""

from __future__ import annotations

import logging
from typing import Optional

from folio import envs
from folio.attention.backend import AttentionBackend
from folio.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

ENV_VAR = "FOLIO_ATTENTION_BACKEND"
BACKENDS = ("cpu_paged", "torch_sdpa")


def get_attention_backend(name: Optional[str] = None) -> AttentionBackend:
    """The named backend, else $FOLIO_ATTENTION_BACKEND, else the fastest one that works here."""
    choice = (name or envs.attention_backend() or "auto").strip().lower()
    if choice not in BACKENDS + ("auto",):
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "torch_sdpa":
        return TorchSDPABackend()
    from folio.attention import cpu_paged

    if cpu_paged.load_extension() is not None:  # logs a warning itself when the build fails
        backend = cpu_paged.CPUPagedAttentionBackend()
        logger.debug("attention backend: cpu_paged")
        return backend
    if choice == "cpu_paged":
        logger.warning("%s=cpu_paged was asked for, but its kernel is unavailable (%s); using torch_sdpa",
                       ENV_VAR, cpu_paged.extension_error())
    return TorchSDPABackend()
