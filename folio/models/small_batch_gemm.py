"""Linear layers for a handful to tens of rows: decode of a few sequences, or the verification of speculated tokens.

Such a matmul is mostly a read of the weight matrix; the C++ kernel (folio/csrc/cpu_small_batch_gemm.cpp)
streams the weight once whatever the number of rows.

bf16 (AVX512-BF16): the kernel reads oneDNN's packed weight in place (`packed_blocks`), so a layer keeps one
copy of its weight for every batch size. oneDNN packs a bf16 weight [N, K] as blocks of 64 output columns
(32 on a CPU with AMX), each [K/2][width][2] (pairs along K, the layout vdpbf16ps and AMX's tiles multiply), which
needs no horizontal sums. On a 2-core Zen 4 EPYC all linear layers of the 0.5B Qwen2 (random weights, from
memory) took 1.23x less time than oneDNN's GEMM at 1 row, 1.15x at 4, 1.12x at 16 and 1.04x at 64
(`benchmarks/small_batch_gemm_bench.py`): there both are bound by the same bf16 dot-product rate from a few
tens of rows on, so the kernel serves every decode-sized batch. With AMX, tiles multiply several times faster
than the kernel's vector units can: on 2 pinned cores of an Emerald Rapids Xeon the vector kernel took the 0.5B
Qwen2's layers 1.25x faster than oneDNN at 1 row and 1.48x at 4 and 8, but 0.61x at 16: MAX_ROWS_AMX is 8.
Past it, up to AMX_ROWS rows, the same packed blocks go to the kernel's own AMX tile loop (`amx_linear`), which
streams them at memory speed where oneDNN's GEMM read them at 14-22 GB/s (the machine reads 30): on 2 cores of
an Emerald Rapids Xeon (`python benchmarks/small_batch_gemm_bench.py --rows 8 9 16 32 48 64 --skip-engine`,
the 0.5B Qwen2's layers) it took 1.17x less time than oneDNN at 9 rows, 1.20-1.24x at 16, 1.30-1.74x at 32,
1.13x at 48 and 1.09-1.24x at 64; at 96 rows 1.08x and at 128 0.93x (`AMX_ROWS` is 64).

float32 (AVX2+FMA or AVX-512F, up to MAX_ROWS rows): oneDNN packs a float32 weight as blocks of 64 output
columns, each [K'][64] (`packed_blocks` recognises it as group 1), and the dense method keeps that copy alone, for
oneDNN's GEMM past MAX_ROWS (prefill chunks; 1.1-1.6x MKL's on the plain weight, which MKL packs on every call
of two rows or more). The kernel reads those blocks a piece of 64 K rows at a time, which stays in L1 while
register tiles of up to 6 rows of x by two vectors of columns pass it (one or two rows: one row at a time over
all 64 columns), the next piece prefetched meanwhile. Against oneDNN's GEMM on the same blocks, all linear layers
of the 0.5B Qwen2 from memory on 2 cores of a Zen 3 EPYC (`python benchmarks/small_batch_gemm_bench.py --dtype
float32`, the machine shared and noisy): 1.3-1.6x as fast at 1-16 rows, 1.1-1.4x at 32, 1.0-1.2x at 48-64 (a
W1 decode step's 62 among them; that step 1.02-1.08x, the two alternating in one engine), 0.9-1.1x at 96-256:
MAX_ROWS is 64. The float32 kernel also reads those blocks in bf16 where a float32 weight holds only bf16 values
(folio.models.bf16_valued), widening them exactly as it loads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import onednn_layout
from folio.platforms.cpu_features import has_amx

KERNEL = CppKernel("folio_cpu_small_batch_gemm", CSRC / "cpu_small_batch_gemm.cpp",
                   what="CPU small-batch GEMM kernel", fallback="small batches use oneDNN or MKL")
# bf16: measured on Zen 4 and on an AMX Xeon (see above)
MAX_ROWS_AMX = 8
MAX_ROWS = {torch.bfloat16: MAX_ROWS_AMX if has_amx() else 64, torch.float32: 64}
# bf16 batches past MAX_ROWS and up to this many rows run `amx_linear` where it serves (0: none, without AMX)
AMX_ROWS = 64 if has_amx() else 0


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 or float32 weight [N, K] in oneDNN's packed layout, read in place: blocks [ceil(N / width),
    K' / group, width, group] with K' >= K, group 2 for bf16 and 1 for float32; columns past N in the last block
    are padding. `blocks` views oneDNN's buffer and keeps it alive."""

    blocks: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight multiplies in (x's and the product's): float32 for blocks of single values, bf16
        ones among them (a float32 weight of bf16 values kept in bf16: folio.models.bf16_valued); else the
        blocks'."""
        return torch.float32 if self.blocks.shape[3] == 1 else self.blocks.dtype


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    ext = KERNEL.load()
    if ext is None:
        return False
    return ext.has_f32_kernel() if dtype == torch.float32 else dtype == torch.bfloat16 and ext.has_kernel()


def packed_blocks(packed: torch.Tensor, weight: torch.Tensor) -> Optional[PackedWeight]:
    """oneDNN's packed copy of a bf16 or float32 weight [N, K] as the kernel reads it, or None where the kernel is
    missing or oneDNN chose a layout it does not read (folio.models.onednn_layout)."""
    if weight.dtype not in onednn_layout.GROUPS or not available(weight.dtype):
        return None
    blocks = onednn_layout.vnni_blocks(packed, weight, onednn_layout.GROUPS[weight.dtype])
    return None if blocks is None else PackedWeight(blocks, weight.shape[0], weight.shape[1])


def weight_rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight [*ids.shape, K], exactly as it was packed: a tied embedding's lookups in its
    lm_head's packed copy. Row n is column n % width of block n // width, its K values in K' / group runs of
    `group`."""
    blocks = weight.blocks
    flat = ids.reshape(-1)
    rows = blocks[flat // blocks.shape[2], :, flat % blocks.shape[2]]  # [T, K' / group, group]
    rows = rows.reshape(flat.shape[0], -1)[:, :weight.in_features].to(weight.dtype).contiguous()
    return rows.view(*ids.shape, weight.in_features)


def serves(x: torch.Tensor) -> bool:
    """Whether a batch x is small enough for the kernel or, in bf16, its AMX tiles (for a layer whose weight
    they serve)."""
    if x.dim() != 2:
        return False
    if x.dtype != torch.bfloat16:
        return x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
    return x.shape[0] <= MAX_ROWS[torch.bfloat16] or (x.shape[0] <= AMX_ROWS and amx_serves(x))


def linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias), in x's dtype (the weight's), for a batch that `serves` takes: bf16 on the
    vector loop up to MAX_ROWS rows, then on the AMX tiles; float32 on its FMA loop."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if _on_tiles(x):
        return amx_linear(x, weight, bias)
    if x.dtype == torch.float32:
        return KERNEL.load().linear_f32(x, weight.blocks, weight.out_features, bias)
    return vector_linear(x, weight, bias)


def _on_tiles(x: torch.Tensor) -> bool:
    """Whether `linear` sends a batch that `serves` takes to the AMX tiles: bf16 past the vector loop's rows."""
    return x.dtype == torch.bfloat16 and x.shape[0] > MAX_ROWS[torch.bfloat16]


def _tiles_take(x: torch.Tensor) -> bool:
    """Whether `linear` would run this batch on the AMX tiles (the batches the tile loop's epilogues serve)."""
    return serves(x) and _on_tiles(x)


def vector_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (bf16, unit stride) @ weight^T (+ bias) on the kernel's vdpbf16ps loop, any M."""
    return KERNEL.load().linear_bf16(x, weight.blocks, weight.out_features, bias)


@functools.cache
def amx_available() -> bool:
    """Whether `amx_linear` runs here: the kernel built for a CPU with AMX-BF16, and the OS lends the tiles."""
    ext = KERNEL.load()
    return ext is not None and ext.has_amx_kernel()


def amx_serves(x: torch.Tensor) -> bool:
    """Whether `amx_linear` takes this batch: K a multiple of 32 (a tile's depth)."""
    return x.shape[-1] % 32 == 0 and amx_available()


def amx_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (bf16, unit stride) @ weight^T (+ bias) on AMX tiles driven by the kernel, any M (`amx_serves`)."""
    return KERNEL.load().linear_bf16_amx(x, weight.blocks, weight.out_features, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: PackedWeight,
                        silu_table: torch.Tensor) -> Optional[torch.Tensor]:
    """For a batch that `linear` sends to the AMX tiles, of a gated weight (folio.models.gated_layout, no bias):
    silu_and_mul's result of the product, [M, N / 2] in the outputs' order, the product never written (the
    epilogue looks each gate up in silu_table, fused_ops.bf16_silu_table, as the op does). None for every other
    batch (the caller takes the op of `linear`'s product)."""
    if not _tiles_take(x):
        return None
    return KERNEL.load().linear_bf16_amx(x.contiguous(), weight.blocks, weight.out_features, None, silu_table)


def linear_argmax(x: torch.Tensor, weight: PackedWeight,
                  bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """For a batch that `linear` sends to the AMX tiles: argmax(linear(x, weight, bias), dim=-1) as int64 [M]
    (first maximum, first NaN), the product never written (a greedy step's lm_head, whose logits would be
    megabytes written and read back by the argmax). None for every other batch (the caller takes its own)."""
    if not _tiles_take(x):
        return None
    return KERNEL.load().linear_bf16_amx_argmax(x.contiguous(), weight.blocks, weight.out_features, bias)
