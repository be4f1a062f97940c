"""The quantised matmul kernels (folio/csrc/cpu_quant_linear.cpp), or their torch references where the kernel
cannot be built: the same arithmetic, only slower (weight-only dequantises the weight on every call).

`isa`: which compiled instruction set runs (0 scalar, 1 AVX2+FMA, 2 AVX-512); by default the best one. Tests
run every compiled one against the references.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import quant_reference

KERNEL = CppKernel("folio_cpu_quant_linear", CSRC / "cpu_quant_linear.cpp",
                   what="CPU quantised linear kernel", fallback="quantised layers run their torch reference")


def available() -> bool:
    return KERNEL.load() is not None


def isas() -> list[int]:
    """The instruction sets compiled into the kernel here, best last; [] without the kernel."""
    ext = KERNEL.load()
    return list(ext.isas()) if ext is not None else []


def _run(name: str, reference, *args, isa: Optional[int] = None) -> torch.Tensor:
    """The kernel `name` on args (with the instruction set asked for), or its torch reference without the kernel."""
    ext = KERNEL.load()
    if ext is None:
        return reference(*args)
    return getattr(ext, name)(*args) if isa is None else getattr(ext, name)(*args, isa)


def weight_only_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], isa: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in x's dtype, W int8 (offsets None) or packed int4 (folio.models.quant_reference)."""
    return _run("weight_only_linear", quant_reference.weight_only_linear, x, w, scales, offsets, bias, isa=isa)


def dequantize(w: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor],
               dtype: torch.dtype = torch.float32, isa: Optional[int] = None) -> torch.Tensor:
    """The weight [N, K] of an int8 (offsets None) or int4 layer (folio.models.quant_reference) in dtype (float32,
    or bf16: the float32 values rounded once)."""
    return _run("dequantize", lambda *args: quant_reference.dequantize(*args[:3]).to(dtype), w, scales, offsets,
                dtype, isa=isa)


def dequantize_packed(w: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], out: torch.Tensor,
                      isa: Optional[int] = None) -> None:
    """The weight of an int8 or int4 layer in bf16, written into `out`, a oneDNN-packed buffer's view
    (folio.models.packed_scratch): the values `dequantize` gives in bf16. Needs the kernel."""
    ext = KERNEL.load()
    ext.dequantize_packed(w, scales, offsets, out) if isa is None else ext.dequantize_packed(w, scales, offsets, out, isa)


def w4a8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                bias: Optional[torch.Tensor], isa: Optional[int] = None) -> torch.Tensor:
    """x [M, K] quantised to int8 per block of 32, times packed int4 W, (+ bias), in x's dtype."""
    return _run("w4a8_linear", quant_reference.w4a8_linear, x, w, scales, offsets, bias, isa=isa)


def w8a8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor],
                rotated: bool = False, isa: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (rotated first if the weight is) quantised per row to int8, times int8 W [N, K] with one scale
    per row, (+ bias), in x's dtype."""
    return _run("w8a8_linear", quant_reference.w8a8_linear, x, w, scales, bias, rotated, isa=isa)


def quantize_rows_unsigned(x: torch.Tensor, rotated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows quantised as w8a8_linear quantises them: (codes + 128 as uint8 [M, K], float32 scales [M])."""
    ext = KERNEL.load()
    if ext is not None:
        codes, scales = ext.quantize_rows_unsigned(x, rotated)
        return codes, scales
    codes, scales = quant_reference.quantize_rows(quant_reference.rotate(x) if rotated else x)
    return (codes.to(torch.int16) + 128).to(torch.uint8), scales


def scale_rows(y: torch.Tensor, row_scales: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out [M, N] (float32 or bf16, contiguous) = float32 y [M, N] times each row's scale (+ bias float32 [N])."""
    ext = KERNEL.load()
    if ext is not None:
        ext.scale_rows(y, row_scales, bias, out)
        return
    y = y * row_scales[:, None]
    out.copy_(y if bias is None else y + bias)


def has_packed_w8a8() -> bool:
    """Whether w8a8_packed_linear is compiled in here (it needs AVX512-VNNI)."""
    ext = KERNEL.load()
    return ext is not None and ext.has_packed_w8a8()


def has_w8a8_tiles() -> bool:
    """Whether the packed W8A8 products can run on brgemm's tiles here (tiles=True below): the kernel and a
    PyTorch whose brgemm multiplies bytes."""
    ext = KERNEL.load()
    return ext is not None and ext.has_w8a8_tiles()


def has_w8a8_amx() -> bool:
    """Whether the tiles are folio's AMX tile loop here (layers whose K is a multiple of 64; brgemm's for the
    others): the kernel built for AMX-INT8, and the OS lends the tile registers."""
    ext = KERNEL.load()
    return ext is not None and ext.has_w8a8_amx()


def w8a8_packed_linear(x: torch.Tensor, blocks: torch.Tensor, column_sums: torch.Tensor, scales: torch.Tensor,
                       bias: Optional[torch.Tensor], rotated: bool, tiles: bool = False,
                       silu_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w8a8_linear with the weight in oneDNN's packed int8 blocks [N / 64, K' / 4, 64, 4], its column sums int32 [N]
    and scales [N] (folio.models.onednn_int8): the same result bit for bit. Kernel only (has_packed_w8a8); tiles:
    each block by PyTorch's brgemm (AMX-INT8 tiles where the CPU has them; has_w8a8_tiles) instead of the
    kernel's vector loop. silu_table (fused_ops.bf16_silu_table, bf16 x): the weight is gated (its rows in
    folio.models.gated_layout's order) and the result is fused_ops.silu_and_mul of the plain weight's, bit for
    bit, [M, N / 2]."""
    return KERNEL.load().w8a8_packed_linear(x, blocks, column_sums, scales, bias, rotated, tiles, silu_table)


def w8_int16_packed_linear(x: torch.Tensor, blocks: torch.Tensor, column_sums: torch.Tensor, scales: torch.Tensor,
                           bias: Optional[torch.Tensor], tiles: bool = False,
                           silu_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quant_reference.w8_int16_linear (x's rows quantised to 16-bit codes) with the weight in oneDNN's packed int8 blocks,
    as w8a8_packed_linear takes them: the reference's result bit for bit. Kernel only (has_packed_w8a8); tiles and
    silu_table as there."""
    return KERNEL.load().w8_int16_packed_linear(x, blocks, column_sums, scales, bias, tiles, silu_table)


def quantize_rows_int16_bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows quantised to 16-bit codes as w8_int16_linear quantises them, split for an int8 GEMM with an
    unsigned source: (high bytes + 128, low bytes + 128, both uint8 [M, K]; float32 scales [M])."""
    ext = KERNEL.load()
    if ext is not None:
        high, low, scales = ext.quantize_rows_int16_bytes(x)
        return high, low, scales
    codes, scales = quant_reference.quantize_rows_int16(x)
    high, low = quant_reference.split_int16(codes)
    return (high + 128).to(torch.uint8), (low + 128).to(torch.uint8), scales
