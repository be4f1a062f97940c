"""Linear layers for a handful to tens of rows: decode of a few sequences, or the verification of speculated tokens.

Such a matmul is mostly a read of the weight matrix; the C++ kernel (folio/csrc/cpu_small_batch_gemm.cpp)
streams the weight once whatever the number of rows.

bf16 (AVX512-BF16): the kernel reads oneDNN's packed weight in place (`packed_blocks`), so a layer keeps one
copy of its weight for every batch size. oneDNN packs a bf16 weight [N, K] as blocks of 64 output columns,
each [K/2][64][2] (pairs along K, the layout vdpbf16ps multiplies), which needs no horizontal sums. On a 2-core
Zen 4 EPYC all linear layers of the 0.5B Qwen2 (random weights, from memory) took 1.23x less time than oneDNN's
GEMM at 1 row, 1.15x at 4, 1.12x at 16 and 1.04x at 64 (`benchmarks/small_batch_gemm_bench.py`): there both
are bound by the same bf16 dot-product rate from a few tens of rows on, so the kernel serves every decode-sized
batch. With AMX, oneDNN's tiles multiply several times faster than the kernel's vector units can: there the
kernel takes only small batches. On 2 pinned cores of an Emerald Rapids Xeon (the device machine's host) the
kernel took the 0.5B Qwen2's layers 1.25x faster than oneDNN at 1 row and 1.48x at 4 and 8, but 0.61x at 16
and 0.23x at 32 (SmolLM2: 1.21x at 8, 0.96x at 16): MAX_ROWS_AMX is 8. oneDNN itself streamed the weights
of those larger decode batches (16-64 rows) at 10-14 GB/s there, where the machine reads 24: up to TILE_ROWS_AMX
rows, the same packed blocks go through PyTorch's brgemm micro-kernel (AMX tiles) block by block, 16 rows a
call, read in place (`tile_linear`). On 2 cores of an Emerald Rapids Xeon (`python
benchmarks/small_batch_gemm_bench.py --rows 6 8 12 16 32 64`, the 0.5B Qwen2's layers, every path in one
process) the tiles took 1.10-1.25x less time than oneDNN at 6 to 16 rows, 0.97-1.03x at 24 and 32, and from 40
rows on oneDNN won (at 48 rows 0.81x, at 62 0.88x): TILE_ROWS_AMX is 32.

float32 (AVX2+FMA or AVX-512F, one to eight rows): MKL packs the whole weight on every call of two rows or more,
so verifying a few speculated tokens cost two to three times a one-token step (SmolLM2's lm_head on an AVX2 EPYC:
14 ms for one row, 33 ms for two, 41 ms for seven); the kernel reads the plain row-major weight, which a float32
layer keeps anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import onednn_layout
from folio.platforms.cpu_features import has_amx

KERNEL = CppKernel("folio_cpu_small_batch_gemm", CSRC / "cpu_small_batch_gemm.cpp",
                   what="CPU small-batch GEMM kernel", fallback="small batches use oneDNN or MKL")
# bf16: measured on Zen 4 and on an AMX Xeon (see above)
MAX_ROWS_AMX = 8
MAX_ROWS = {torch.bfloat16: MAX_ROWS_AMX if has_amx() else 64, torch.float32: 8}
# bf16 batches past MAX_ROWS and up to this many rows run `tile_linear` (0: none, on CPUs without AMX)
TILE_ROWS_AMX = 32
TILE_ROWS = TILE_ROWS_AMX if has_amx() else 0


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 weight [N, K] in oneDNN's packed layout, read in place: blocks [ceil(N / width), K' / 2, width, 2]
    with K' >= K; columns past N in the last block are padding. `blocks` views oneDNN's buffer and keeps it alive."""

    blocks: torch.Tensor
    out_features: int


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    ext = KERNEL.load()
    if ext is None:
        return False
    return ext.has_f32_kernel() if dtype == torch.float32 else dtype == torch.bfloat16 and ext.has_kernel()


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this plain float32 weight here."""
    return (weight.is_cpu and weight.dim() == 2 and weight.dtype == torch.float32 and weight.is_contiguous()
            and available(torch.float32))


def packed_blocks(packed: torch.Tensor, weight: torch.Tensor) -> Optional[PackedWeight]:
    """oneDNN's packed copy of a bf16 weight [N, K] as the kernel reads it, or None where the kernel is missing
    or oneDNN chose a layout it does not read (folio.models.onednn_layout)."""
    if not (available(torch.bfloat16) and weight.dtype == torch.bfloat16):
        return None
    blocks = onednn_layout.vnni_blocks(packed, weight, 2)
    return None if blocks is None else PackedWeight(blocks, weight.shape[0])


def serves(x: torch.Tensor) -> bool:
    """Whether a batch x is small enough for the kernel or, in bf16, the tiles (for a layer whose weight they
    serve)."""
    most = max(MAX_ROWS[torch.bfloat16], TILE_ROWS) if x.dtype == torch.bfloat16 else MAX_ROWS.get(x.dtype, 0)
    return x.dim() == 2 and x.shape[0] <= most


def linear(x: torch.Tensor, weight: Union[PackedWeight, torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias), in x's dtype, for a batch that `serves` takes: bf16 x with a PackedWeight
    (the kernel up to MAX_ROWS rows, then the tiles), float32 x with a plain float32 weight [N, K]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if isinstance(weight, PackedWeight):
        if x.shape[0] > MAX_ROWS[torch.bfloat16]:
            return tile_linear(x, weight, bias)
        return vector_linear(x, weight, bias)
    return KERNEL.load().linear_f32(x, weight, bias)


def vector_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (bf16, unit stride) @ weight^T (+ bias) on the kernel's vdpbf16ps loop, any M."""
    return KERNEL.load().linear_bf16(x, weight.blocks, weight.out_features, bias)


def tile_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (bf16, unit stride) @ weight^T (+ bias) by brgemm on each block of the packed weight, any M."""
    return KERNEL.load().linear_bf16_tiles(x, weight.blocks, weight.out_features, bias)
