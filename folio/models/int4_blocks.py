"""int4 weights in column blocks, for bf16 activations on AVX512-BF16 and float32 ones on AVX2
(folio/csrc/cpu_int4_blocks.cpp).

The int4 formats of folio.models.quant_reference (row-major nibbles, float32 scales and offsets [N, K / G]) are
what checkpoints, GGUF files and the quantiser produce; on CPUs with AVX512-BF16 a weight-only int4 layer
serving bf16 activations repacks its weight once at load into blocks of 64 output columns (`pack`, in C++:
3 ms for the 0.5B Qwen2's largest layer) and keeps only that copy. Its kernel widens nibbles to bf16 by one
shift and one logic op and multiplies them with vdpbf16ps without horizontal sums, as bf16's small-batch
kernel reads oneDNN's packed weights, where the row-major kernel was bound by widening (15 GB/s against bf16's
43 on Zen 4). Larger batches run oneDNN's GEMM on the weight dequantised from the blocks for the call, into
a packed scratch weight (`dense_linear`, folio.models.packed_scratch).

On CPUs with AVX2 and no AVX-512 a float32 layer reads the same blocks with integer products: each row of x
rounded to 16-bit codes (quant_reference.w4_int16_linear is the reference), the nibbles isolated in place and
multiplied by vpmaddwd, 16 products in one instruction summed exactly in int32, then scaled in float32 once a
group (scales and offsets stay float32). It takes every batch: from 3 rows on the nibbles are decoded once per
panel of rows into 16-bit tiles (csrc/int16_tiles.h), with the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import packed_scratch
from folio.platforms.cpu_features import has_amx, has_avx512

KERNEL = CppKernel("folio_cpu_int4_blocks", CSRC / "cpu_int4_blocks.cpp", what="CPU int4 block kernel",
                   fallback="int4 layers keep the row-major kernel")
COLUMNS = 64  # output columns per block
# bf16 batches of up to this many rows run the kernel, larger ones the dense GEMM on the dequantised weight
# (benchmarks/int4_blocks_bench.py, all linear layers of the 0.5B Qwen2 from memory, 2 threads). On Zen 4
# 63-72 ms at 64 rows against 100-120 for dequantising and oneDNN's GEMM, even at 128 rows; on an Emerald Rapids
# Xeon, whose AMX tiles make the GEMM cheap, 80 against 88 ms at 16 rows but 157 against 94 at 32.
MAX_ROWS = 16 if has_amx() else 64


def runs_kernel(x: torch.Tensor) -> bool:
    """Whether the kernel takes this batch (else dense_linear): float32 ones of every size, since from 3 rows
    the AVX2 kernel decodes the blocks once per panel of rows into int16 tiles (csrc/int16_tiles.h), which beat
    F.linear on the dequantised float32 weight at every size measured (Zen 3, 2 threads, the default model's and
    the 0.5B Qwen2's layers, 192 to 2048 rows: 1.0-2.3x); bf16 ones up to MAX_ROWS."""
    return x.dtype == torch.float32 or x.shape[0] <= MAX_ROWS


@dataclass(frozen=True)
class Int4Blocks:
    """codes uint8 [ceil(N / 64), K / 2, 64]: per block and pair of K, 32 16-bit words, nibble v of word i the
    code of column 16 v + i // 2 at k = 2 p + i % 2; scales (16 x each group's scale) and offsets
    [ceil(N / 64), K / G, 64], float16 for bf16 activations, float32 for float32 ones. Columns past N are zero."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype these blocks serve (and their dequantised weight's)."""
        return torch.bfloat16 if self.scales.dtype == torch.float16 else torch.float32


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether layers with activations in dtype keep their int4 weights as blocks here: bf16 with the
    AVX512-BF16 kernel; float32 with the AVX2 one on CPUs without AVX-512, where it streams 3x faster than the
    row-major kernel's 8-lane widening (README, "Low precision"; with AVX-512 the row-major kernel's 16-lane path
    was not measured against it and stays)."""
    ext = KERNEL.load()
    if ext is None:
        return False
    if dtype == torch.float32:
        return ext.has_f32_kernel() and not has_avx512()
    return dtype == torch.bfloat16 and ext.has_kernel()


def pack(weight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
         dtype: torch.dtype = torch.bfloat16) -> Optional[Int4Blocks]:
    """The blocks of an int4 weight in folio.models.quant_reference's format (packed uint8 [N, K / 2], scales
    and offsets float32 [N, K / G]) for activations in dtype, or None where a scale or offset lies beyond
    float16's range (bf16). For bf16 scales and offsets are rounded to float16: exact for folio's quantiser and
    GGUF's Q4_0 / Q4_1, within 2^-12 of each value for Q4_K's and GPTQ's products of a scale and an integer;
    float32 keeps them as they are."""
    codes, block_scales, block_offsets = KERNEL.load().pack(weight, scales, offsets, dtype == torch.bfloat16)
    if not (bool(block_scales.isfinite().all()) and bool(block_offsets.isfinite().all())):
        return None
    return Int4Blocks(codes, block_scales, block_offsets, weight.shape[0])


def linear(x: torch.Tensor, weight: Int4Blocks, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W^T (+ float32 bias [N]) in x's dtype, the blocks' (either kernel where it is compiled in: tests
    run the float32 one on AVX-512 CPUs too)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return KERNEL.load().linear(x, weight.codes, weight.scales, weight.offsets, weight.out_features, bias)


def dense_linear(x: torch.Tensor, weight: Int4Blocks, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """bf16 x [M, K] @ W^T (+ float32 bias [N]) for batches past the kernel's: oneDNN's GEMM on the weight
    dequantised into the packed scratch of its shape (folio.models.packed_scratch), or where there is none
    F.linear on the dequantised W^T."""
    def write(blocks: torch.Tensor) -> None:
        KERNEL.load().dequantize_packed(weight.codes, weight.scales, weight.offsets, weight.out_features, blocks)

    return packed_scratch.linear(x, weight.out_features, write, lambda: dequantize(weight), bias)


def dequantize(weight: Int4Blocks) -> torch.Tensor:
    """The bf16 weight [N, K] of blocks with float16 scales (a transposed view of [K, N], which the GEMM reads as
    fast): each value q * scale + offset by one float32 FMA, rounded once."""
    return KERNEL.load().dequantize_transposed(weight.codes, weight.scales, weight.offsets, weight.out_features).t()
