"""W8A8 matmuls of many rows in oneDNN's int8 GEMM, on CPUs with AVX512-VNNI or AMX-INT8.

folio's own W8A8 kernel (folio/csrc/cpu_quant_linear.cpp) reads each weight row once per few rows of x: the
fastest at one row, but it does not block for cache or registers, so from a few rows on a real GEMM wins. oneDNN's
int8 GEMM (PyTorch's `onednn::qlinear_pointwise`, the x86 quantisation backend's op) is that GEMM: its VNNI
kernels (vpdpbusd, 64 products an instruction, twice vdpbf16ps's) on AVX512-VNNI, AMX-INT8 tiles (twice AMX-BF16's
rate) on Intel's newer Xeons. Measured on a Zen 4 EPYC (AVX512-VNNI, 2 cores, benchmarks/int8_gemm_bench.py):
a 9728 x 896 layer at 64 rows 0.69 ms against bf16's 1.11 and folio's row-major kernel's 2.18, at 2 rows level
with that kernel and at 1 row 1.4x slower than it.

Its VNNI kernels take an unsigned source (vpdpbusd multiplies unsigned by signed bytes): the activations are
quantised per token as the kernel quantises them (rotated first for rotated layers), shifted to q + 128 and
given oneDNN with a zero point of 128, which it takes back exactly (it subtracts 128 times the weight's column
sums), so the int32 sums are exact and equal the reference's. oneDNN multiplies them by the weight's per-channel
scales; each row is then multiplied by its own token's scale (oneDNN has one activation scale per tensor) and the
bias added, in one pass (quant_kernels.scale_rows). The result differs from the reference only by the order of
the two float32 scalings.

Only where the CPU has VNNI or AMX-INT8 (`usable`): without them oneDNN pairs products in int16 with saturation
(vpmaddubsw), exact only for weights within 6 bits. Batches of fewer than `PackedInt8Weight.min_rows` rows go to a
folio kernel instead: with VNNI the one that reads oneDNN's packed weight in place (quant_kernels.
w8a8_packed_linear; oneDNN packs int8 weights as blocks of 64 columns, each [K/4][64][4]: folio.models.
onednn_layout), so the layer keeps that one copy of its weight. On Zen 4, all linear layers of the 0.5B Qwen2
from memory (`python benchmarks/int8_gemm_bench.py --shapes 1152x896,896x896,9728x896,896x4864 --copies 24`) took
1.70x less time than in oneDNN at 1 row, 1.80x at 4, 1.31x at 8, 1.21x at 12 and 0.97x at 16 (and 1.19x less
than folio's row-major kernel at 1 row). Where oneDNN lays the weight out otherwise, the layer keeps its own copy
for folio's row-major kernel too. Tests run this path on any CPU with weights within 6 bits.

On AMX-INT8 (2 pinned cores of an Emerald Rapids Xeon, the device machine's host) oneDNN overtook the packed
kernel from 16 rows (all layers of the 0.5B Qwen2: 37.0 against 41.4 ms at 16 rows, 24.1 against 22.9 at 8) but
streamed decode batches' weights at half the bandwidth: at 64 rows no faster than bf16 (9728 x 896: 0.86 against
0.91 ms; 896 x 4864: 0.77 against 0.65), and W1 in int8 ran at 0.83x bf16. So batches of min_rows to
`tile_rows` rows go to the tiles: the packed blocks read in place, each times all rows by PyTorch's brgemm
(oneDNN's micro-kernel: AMX-INT8 tiles there, vpdpbusd on VNNI; quant_kernels.w8a8_packed_linear with tiles),
then the packed kernel's epilogue, so the same result bit for bit. On Zen 4 they beat both the packed kernel and
oneDNN's GEMM from 12 rows to 256 (below). With AMX-INT8 the tiles are folio's own AMX tile loop (amx_tiles.h,
where K is a multiple of 64; brgemm otherwise), which streams the blocks with prefetches: on 2 cores of an
Emerald Rapids Xeon (all the 0.5B Qwen2's layers from memory, `python benchmarks/int8_gemm_bench.py --shapes
1152x896,896x896,9728x896,896x4864 --copies 24 --rows 1,2,4,6,8,12,16,32,64,96,128`), ms: 1 row 13.9 against
the packed kernel's 13.4, 2 rows 13.2 against 13.5, 4 rows 14.4 against 15.2, 8 rows 15.5 against 19.6, 16
rows 16.8 (packed 26.2, oneDNN 26.6), 64 rows 28.7 (oneDNN 43.6; bf16's GEMM 39.0). Past 64 rows the loop runs
as a GEMM (2 x 2 tiles over each block's whole K, the weight in L2 for all rows): the same command, 128 rows
48.5 against oneDNN's 61.4, 256 rows 99.3 against 139.9, 1852 rows 545 against 671 (bf16's GEMM 653); with the
layers in cache, 1852 rows 17.4 against 25.2 ms (bf16 19.9). So on AMX-INT8 the tiles take every batch from
MIN_ROWS_AMX rows on, prefill chunks included: W1 in `int8` went from 1.15x bf16's output tokens/s to 1.28-1.31x.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from folio.models import gated_layout, onednn_layout, quant_kernels
from folio.platforms.cpu_features import has_amx_int8, has_avx512_vnni

# the weight is packed for a batch of this many rows (prefill chunks and decode batches of tens of requests)
_PACK_FOR_ROWS = 64
# from this many rows oneDNN (or the tiles) beats folio's packed kernel: measured on Zen 4 with VNNI (see above;
# the row-major kernel, the packed one) and on AMX (the tiles)
MIN_ROWS_VNNI = 2
MIN_ROWS_VNNI_PACKED = 16
MIN_ROWS_AMX = 4
# With the tiles (a PyTorch whose brgemm multiplies bytes), batches from min_rows up to tile_rows rows go to them
# instead of oneDNN: on VNNI from 12 rows (below, the packed kernel) up to 256; on AMX-INT8 from MIN_ROWS_AMX on,
# any number (above). On Zen 4, all linear layers of the 0.5B Qwen2 from memory
# (benchmarks/int8_gemm_bench.py, copies 24), ms: at 8 rows the tiles and the packed kernel level (21.4 against
# 22.4, 20.7 against 19.4), at 16 27.0 against 34.5 (oneDNN 44.8), at 64 70.0 against 84.6 for oneDNN, at 256
# 305 against 333.
TILES_FROM_VNNI, TILE_ROWS_VNNI = 12, 256
TILE_ROWS_AMX = 1 << 62  # no limit: folio's tile loop
BRGEMM_ROWS_AMX = 128  # brgemm's tiles, where the loop cannot run (K not a multiple of 64, no tile registers)
# rows of one oneDNN call: its float32 result (256 x 9728 x 4 bytes = 10 MB for Qwen2-0.5B's gate/up) stays in
# the last-level cache for the scaling pass; a 2048-row chunk wrote 80 MB to memory and read it back
CHUNK_ROWS = 256
_SUM_ROWS = 4096


def available() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def usable() -> bool:
    """Whether W8A8 layers should use it here: a CPU with AVX512-VNNI or AMX-INT8 (see the module's docstring)."""
    return (has_amx_int8() or has_avx512_vnni()) and available()


@dataclass
class PackedInt8Weight:
    """An int8 weight [N, K] in oneDNN's layout, with its float32 per-channel scales [N]; `blocks` views that
    layout for folio's small-batch kernel where it can read it (with the weight's column sums), else None."""

    packed: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor  # int64 [N] of zeros: the weights are symmetric
    blocks: Optional[torch.Tensor]
    column_sums: Optional[torch.Tensor]
    min_rows: int  # batches of fewer rows go to folio's kernels on this CPU, the others to oneDNN,
    tile_rows: int  # but those of up to this many rows to the tiles (0: none)
    # a gated weight (prepack's gated): fused_ops' bf16 silu table, which folio's epilogue looks its gates up in
    silu_table: Optional[torch.Tensor] = None

    def on_blocks(self, rows: int) -> Optional[bool]:
        """Where a batch of `rows` rows runs: on the blocks with the kernel's vector loop (False) or the tiles
        (True), or None for oneDNN."""
        if rows < self.min_rows and self.blocks is not None:
            return False
        return True if rows <= self.tile_rows else None


def _row_sums(weight: torch.Tensor) -> torch.Tensor:
    """int32 [N]: the sums of weight's rows, a few thousand rows at a time (the sum widens them to int32 first:
    a 151936 x 896 lm_head whole would take 0.5 GB)."""
    return torch.cat([chunk.sum(dim=1, dtype=torch.int32) for chunk in weight.split(_SUM_ROWS)])


def prepack(weight: torch.Tensor, scales: torch.Tensor, gated: bool = False) -> PackedInt8Weight:
    """weight int8 [N, K], scales float32 [N]. gated: the weight is a gated MLP's gate/up (gates first) whose
    product is only ever taken through silu_and_mul (Linear's silu_and_mul): where every batch of a bf16 x runs on
    folio's epilogue, its rows are laid out for that epilogue to compute SiLU-and-mul (gated_layout.
    interleave_gated), so the layer writes half the result and skips the op's pass over it (`silu_table` is then
    set); elsewhere (batches past tile_rows go to oneDNN, whose product has no such epilogue) the weight is packed
    as it is. The 0.5B Qwen2's MLP (gate/up, SiLU-and-mul, down), the two alternating in one process on 2 cores of
    an Emerald Rapids Xeon: 1.02-1.06x at 62 rows, 1.04-1.09x at 1852 (three runs); the epilogue's table lookups
    (two gathers of 16 a row and block) cost about what halving its stores saves, so the gain is the op's pass.
    SiLU computed in the epilogue from SLEEF's exp, before the op had its table, measured 0.95-1.05x."""
    table = gated_layout.silu_table(weight.shape[0]) if gated else None
    if table is not None and has_amx_int8() and quant_kernels.has_w8a8_amx() and weight.shape[1] % 64 == 0:
        packed = prepack(gated_layout.interleave_gated(weight), gated_layout.interleave_gated(scales))
        if packed.tile_rows == TILE_ROWS_AMX:  # every batch on the blocks
            return dataclasses.replace(packed, silu_table=table)
    packed = torch.ops.onednn.qlinear_prepack(weight, [_PACK_FOR_ROWS, weight.shape[1]])
    # the kernel reads blocks of 64 columns
    blocks = onednn_layout.vnni_blocks(packed, weight, 4, widths=(64,)) if quant_kernels.has_packed_w8a8() else None
    column_sums = None if blocks is None else _row_sums(weight)
    tiles = blocks is not None and quant_kernels.has_w8a8_tiles()
    if has_amx_int8():
        loop = quant_kernels.has_w8a8_amx() and weight.shape[1] % 64 == 0  # else brgemm's tiles, per block
        min_rows, tile_rows = MIN_ROWS_AMX, (TILE_ROWS_AMX if loop else BRGEMM_ROWS_AMX) if tiles else 0
    elif tiles:
        min_rows, tile_rows = TILES_FROM_VNNI, TILE_ROWS_VNNI
    else:
        min_rows, tile_rows = MIN_ROWS_VNNI if blocks is None else MIN_ROWS_VNNI_PACKED, 0
    return PackedInt8Weight(packed, scales.contiguous(), torch.zeros(weight.shape[0], dtype=torch.int64), blocks,
                            column_sums, min_rows, tile_rows)


def linear(x: torch.Tensor, weight: PackedInt8Weight, bias: Optional[torch.Tensor], rotated: bool) -> torch.Tensor:
    """x [M, K] (rotated first if the weight is) quantised per row to int8, times the weight, (+ bias float32),
    in x's dtype: fewer than weight.min_rows rows on folio's kernel that reads the blocks (callers send smaller
    batches elsewhere when there are none), then up to weight.tile_rows on the tiles, more in oneDNN, in chunks
    of CHUNK_ROWS rows, so that oneDNN's float32 result is still in cache when it is scaled. A gated weight's
    result is silu_and_mul's of that product, [M, N / 2] (bf16 x)."""
    tiles = weight.on_blocks(x.shape[0])
    if tiles is not None:
        return quant_kernels.w8a8_packed_linear(x, weight.blocks, weight.column_sums, weight.scales, bias, rotated,
                                                tiles, weight.silu_table)
    codes, row_scales = quant_kernels.quantize_rows_unsigned(x, rotated)
    return _scaled_in_chunks(x, weight, bias, row_scales, lambda rows: _gemm(codes[rows], weight))


def linear_int16(x: torch.Tensor, weight: PackedInt8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] quantised per row to 16-bit codes, times the weight, (+ bias float32), in x's dtype
    (quant_reference.w8_int16_linear): fewer than weight.min_rows rows on folio's kernel that reads the blocks,
    then up to weight.tile_rows on the tiles, more (or without blocks) as two oneDNN GEMMs, one per signed byte
    of the codes, whose float32 results combine as 256 high + low before the scaling. A gated weight's result is
    silu_and_mul's, as in linear."""
    tiles = weight.on_blocks(x.shape[0])
    if tiles is not None:
        return quant_kernels.w8_int16_packed_linear(x, weight.blocks, weight.column_sums, weight.scales, bias, tiles,
                                                    weight.silu_table)
    high, low, row_scales = quant_kernels.quantize_rows_int16_bytes(x)
    return _scaled_in_chunks(x, weight, bias, row_scales, lambda rows: torch.add(
        _gemm(low[rows], weight), _gemm(high[rows], weight), alpha=256))


def _scaled_in_chunks(x: torch.Tensor, weight: PackedInt8Weight, bias: Optional[torch.Tensor],
                      row_scales: torch.Tensor, sums: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """The result [M, N] in x's dtype: sums(rows) (float32, already times the weight's scales) for CHUNK_ROWS rows
    at a time, each scaled by its row's scale (+ bias) while still in cache."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32  # the epilogue's two
    out = torch.empty(x.shape[0], weight.scales.shape[0], dtype=dtype)
    for start in range(0, x.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        quant_kernels.scale_rows(sums(rows), row_scales[rows], bias, out[rows])
    return out.to(x.dtype)


def _gemm(codes: torch.Tensor, weight: PackedInt8Weight) -> torch.Tensor:
    """oneDNN's int8 GEMM: float32 [M, N] = (codes uint8 [M, K] - 128) times the weight, times its scales."""
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, 128, weight.packed, weight.scales, weight.zero_points,
                                              None, 1.0, 0, torch.float32, "none", [], "")
