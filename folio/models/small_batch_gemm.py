"""Linear layers for a handful of rows: decode of a few sequences, or the verification of a few speculated tokens.

Such a matmul is a read of the weight matrix; the C++ kernel (folio/csrc/cpu_small_batch_gemm.cpp) streams the
plain row-major weight once whatever the number of rows.

bf16 (AVX512-BF16, one to three rows): oneDNN's packed bf16 GEMM reads its weights at 15-23 GB/s on a 2-core
AVX512-BF16 machine, the kernel at 25-31 GB/s, which made single-sequence decode of SmolLM2-135M 1.56x faster
(19.9 -> 12.8 ms per token; benchmarks/small_batch_gemm_bench.py). Larger batches stay on oneDNN, whose packed
layout the kernel cannot read: so a layer needs its plain weight besides the packed one. The tied lm_head keeps
it anyway (it is the embedding); for the other layers the copies cost their size once more, so they are kept
only while that stays under MAX_MEMORY_FRACTION of available memory (small models, where fixed per-call costs
weigh most and memory is cheap).

float32 (AVX2+FMA or AVX-512F, one to eight rows): MKL packs the whole weight on every call of two rows or more,
so verifying a few speculated tokens cost two to three times a one-token step (SmolLM2's lm_head on an AVX2 EPYC:
14 ms for one row, 33 ms for two, 41 ms for seven); the kernel reads the plain weight, which a float32 layer
keeps anyway, so it costs no memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.memory import available_memory_bytes

KERNEL = CppKernel("folio_cpu_small_batch_gemm", CSRC / "cpu_small_batch_gemm.cpp",
                   what="CPU small-batch bf16 GEMM kernel", fallback="small batches use oneDNN")
# measured: bf16 at 4 rows oneDNN is as fast, beyond it faster; float32 the kernel stays ahead of MKL to 8 rows
MAX_ROWS = {torch.bfloat16: 3, torch.float32: 8}
MAX_MEMORY_FRACTION = 0.1


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    ext = KERNEL.load()
    if ext is None:
        return False
    return ext.has_f32_kernel() if dtype == torch.float32 else dtype == torch.bfloat16 and ext.has_kernel()


def worth_copies(num_bytes: int) -> bool:
    """Whether plain copies of num_bytes of weights should be kept for the kernel."""
    return available() and num_bytes <= MAX_MEMORY_FRACTION * available_memory_bytes()


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this weight here (bf16 needs K % 32 == 0)."""
    if not (weight.is_cpu and weight.dim() == 2 and available(weight.dtype)):
        return False
    return weight.is_contiguous() and (weight.dtype == torch.float32 or weight.shape[1] % 32 == 0)


def serves(x: torch.Tensor) -> bool:
    """Whether a batch x is small enough for the kernel (for a layer whose weight it supports)."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M <= MAX_ROWS[dtype], K] @ weight [N, K]^T (+ bias), in x's dtype (bf16 or float32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return KERNEL.load().small_batch_linear(x, weight, bias)
