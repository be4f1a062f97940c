"""int8 weights in column blocks, for float32 activations on AVX2 CPUs without AVX-512
(folio/csrc/cpu_int8_blocks.cpp).

There a weight-only int8 layer (`w8a16`, GGUF's Q8_0, the int8 lm_head of the int4 schemes and of a GGUF file)
ran the row-major kernel, which widens every weight to float32 for every row of x: bound by that widening, its
time grew with the rows (the default model's head: 2.1 ms at 1 row, 23 ms at 32). Its weight is repacked once at
load into blocks of 64 output columns (`pack`) and only that copy is kept; each row of x is rounded to 16-bit
codes (quant_reference.w8_int16_grouped_linear is the reference) and the kernel sums 16 exact integer products
per instruction, reading each block once per two rows. It serves every batch size: on a Zen 3 EPYC it beat
F.linear on the dequantised float32 weight up to the 1024-2048 rows measured (cpu_int8_blocks.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.platforms.cpu_features import has_avx512

KERNEL = CppKernel("folio_cpu_int8_blocks", CSRC / "cpu_int8_blocks.cpp", what="CPU int8 block kernel",
                   fallback="int8 layers keep the row-major kernel")


@dataclass(frozen=True)
class Int8Blocks:
    """codes int8 [ceil(N / 64), K / 2, 128]: per block and pair of K, column c's values at k = 2p and 2p + 1 in
    bytes 2c and 2c + 1; scales float32 [ceil(N / 64), K / G, 64]. Columns past N are zero."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int


def available(dtype: torch.dtype) -> bool:
    """Whether int8 weight-only layers with activations in dtype keep their weights as blocks here: float32 on
    CPUs with AVX2 and without AVX-512 (where the AVX-512 kernels' float widening was not measured against it)."""
    ext = KERNEL.load()
    return dtype == torch.float32 and ext is not None and ext.has_kernel() and not has_avx512()


def packable(input_size: int, scales: torch.Tensor) -> bool:
    """Whether a weight of this K and these scales [N, K / G] fits the blocks: groups of a multiple of 32."""
    groups = scales.shape[1]
    return input_size % groups == 0 and (input_size // groups) % 32 == 0


def pack(weight: torch.Tensor, scales: torch.Tensor) -> Int8Blocks:
    """The blocks of an int8 weight in folio.models.quant_reference's format (int8 [N, K], scales float32
    [N, K / G])."""
    codes, block_scales = KERNEL.load().pack(weight.contiguous(), scales.contiguous())
    return Int8Blocks(codes, block_scales, weight.shape[0])


def linear(x: torch.Tensor, weight: Int8Blocks, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 x [M, K] @ W^T (+ float32 bias [N])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return KERNEL.load().linear(x, weight.codes, weight.scales, weight.out_features, bias)
