"""int4 weights in column blocks, for bf16 activations on AVX512-BF16 (folio/csrc/cpu_int4_blocks.cpp).

The int4 formats of folio.models.quant_reference (row-major nibbles, float32 scales and offsets [N, K / G]) are
what checkpoints, GGUF files and the quantiser produce; on CPUs with AVX512-BF16 a weight-only int4 layer
serving bf16 activations repacks its weight once at load into blocks of 64 output columns (`pack`, in C++:
3 ms for the 0.5B Qwen2's largest layer) and keeps only that copy. Its kernel widens nibbles to bf16 by one
shift and one logic op and multiplies them with vdpbf16ps without horizontal sums, as bf16's small-batch
kernel reads oneDNN's packed weights, where the row-major kernel was bound by widening (15 GB/s against bf16's
43 on Zen 4). Larger batches run oneDNN's GEMM on the weight dequantised from the blocks for the call, into
a packed scratch weight (`dense_linear`, folio.models.packed_scratch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import packed_scratch, small_batch_gemm

KERNEL = CppKernel("folio_cpu_int4_blocks", CSRC / "cpu_int4_blocks.cpp", what="CPU int4 block kernel",
                   fallback="int4 layers keep the row-major kernel")
COLUMNS = 64  # output columns per block
# Batches of up to this many rows run the kernel, larger ones the dense GEMM on the dequantised weight. The
# kernel multiplies with the same vdpbf16ps as bf16's small-batch kernel and has its crossover with oneDNN:
# on Zen 4 (all linear layers of the 0.5B Qwen2 from memory) 63-72 ms at 64 rows against 100-120 for
# dequantising and oneDNN's GEMM, even at 128 rows (benchmarks/int4_blocks_bench.py); with AMX oneDNN's tiles
# win sooner (not yet measured there).
MAX_ROWS = small_batch_gemm.MAX_ROWS[torch.bfloat16]


@dataclass(frozen=True)
class Int4Blocks:
    """codes uint8 [ceil(N / 64), K / 2, 64]: per block and pair of K, 32 16-bit words, nibble v of word i the
    code of column 16 v + i // 2 at k = 2 p + i % 2; scales (16 x each group's scale) and offsets float16
    [ceil(N / 64), K / G, 64]. Columns past N are zero."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int


def available() -> bool:
    ext = KERNEL.load()
    return ext is not None and ext.has_kernel()


def pack(weight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Optional[Int4Blocks]:
    """The blocks of an int4 weight in folio.models.quant_reference's format (packed uint8 [N, K / 2], scales
    and offsets float32 [N, K / G]), or None where a scale or offset lies beyond float16's range. Scales and
    offsets are rounded to float16: exact for folio's quantiser and GGUF's Q4_0 / Q4_1, within 2^-12 of
    each value for Q4_K's and GPTQ's products of a scale and an integer."""
    codes, half_scales, half_offsets = KERNEL.load().pack(weight, scales, offsets)
    if not (bool(half_scales.isfinite().all()) and bool(half_offsets.isfinite().all())):
        return None
    return Int4Blocks(codes, half_scales, half_offsets, weight.shape[0])


def linear(x: torch.Tensor, weight: Int4Blocks, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """bf16 x [M, K] @ W^T (+ float32 bias [N]) in bf16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return KERNEL.load().linear(x, weight.codes, weight.scales, weight.offsets, weight.out_features, bias)


def dense_linear(x: torch.Tensor, weight: Int4Blocks, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """bf16 x [M, K] @ W^T (+ float32 bias [N]) for batches past the kernel's: oneDNN's GEMM on the weight
    dequantised into the packed scratch of its shape (folio.models.packed_scratch), or where there is none,
    F.linear on the dequantised W^T."""
    return packed_scratch.linear(x, weight.out_features, lambda blocks: KERNEL.load().dequantize_packed(
        weight.codes, weight.scales, weight.offsets, weight.out_features, blocks), lambda: dequantize(weight), bias)


def dequantize(weight: Int4Blocks) -> torch.Tensor:
    """The bf16 weight [N, K] (a transposed view of [K, N], which the GEMM reads as fast): each value
    q * scale + offset by one float32 FMA, rounded to bf16."""
    return KERNEL.load().dequantize_transposed(weight.codes, weight.scales, weight.offsets, weight.out_features).t()
