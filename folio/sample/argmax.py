"""Row-wise argmax of a logits batch: the last step of greedy decoding and of the exponential race.

torch's CPU argmax is a scalar reduction (19 ms for bf16 [64, 151936] logits, 6.5 ms in float32, more than
a whole decode step's attention for a small model); the C++ kernel (folio/csrc/cpu_argmax.cpp) streams each
row once with AVX-512 and returns the same indices, ties and NaNs included. Other devices and dtypes, or no
kernel (build failed, FOLIO_DISABLE_CPU_KERNELS=1), use torch.argmax.
"""

from __future__ import annotations

import torch

from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_argmax", CSRC / "cpu_argmax.cpp", what="CPU argmax kernel",
                   fallback="using torch.argmax")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a [B, V] tensor, as int64 [B]."""
    if (logits.is_cpu and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.shape[1] > 0 and logits.stride(1) == 1):
        ext = KERNEL.load()
        if ext is not None:
            return ext.argmax_rows(logits)
    return logits.argmax(dim=-1)


def prepare() -> None:
    """Build or load the kernel now (at model load), not in the first step."""
    KERNEL.load()
