"""bf16 linear layers for one to three rows: the decode of one to three sequences at a time.

Such a matmul is a read of the weight matrix. oneDNN's packed bf16 GEMM reads it at 15-23 GB/s on a 2-core
AVX512-BF16 machine; the C++ kernel (folio/csrc/cpu_small_batch_gemm.cpp) streams plain row-major weights
at 25-31 GB/s there, which made single-sequence decode of SmolLM2-135M 1.56x faster (19.9 -> 12.8 ms per
token; benchmarks/small_batch_gemm_bench.py). Larger batches stay on oneDNN, whose packed layout the
kernel cannot read: so a layer needs its plain weight besides the packed one. The tied lm_head keeps it
anyway (it is the embedding); for the other layers the copies cost their size once more, so they are kept
only while that stays under MAX_MEMORY_FRACTION of available memory (small models, where fixed per-call
costs weigh most and memory is cheap).
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.memory import available_memory_bytes

KERNEL = CppKernel("folio_cpu_small_batch_gemm", CSRC / "cpu_small_batch_gemm.cpp",
                   what="CPU small-batch bf16 GEMM kernel", fallback="small batches use oneDNN")
MAX_ROWS = 3  # measured: at 4 rows oneDNN is as fast, beyond it faster
MAX_MEMORY_FRACTION = 0.1


def available() -> bool:
    ext = KERNEL.load()
    return ext is not None and ext.has_kernel()


def worth_copies(num_bytes: int) -> bool:
    """Whether plain copies of num_bytes of weights should be kept for the kernel."""
    return available() and num_bytes <= MAX_MEMORY_FRACTION * available_memory_bytes()


def supports(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2 and weight.shape[1] % 32 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K]^T (+ bias) in bf16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return KERNEL.load().small_batch_linear(x, weight, bias)
