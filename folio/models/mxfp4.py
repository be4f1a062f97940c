"""MXFP4 (OCP microscaling FP4) weights, as GPT-OSS's official checkpoints store their experts: the format, and its
dequantisation.

A weight [rows, cols] is stored as two tensors: `*_blocks` uint8 [rows, cols / 32, 16], 32 FP4 (E2M1) codes per
block, two a byte, the low nibble first (the even column); and `*_scales` uint8 [rows, cols / 32], each block's
scale as an E8M0 exponent (2^(s - 127)). A value is FP4_VALUES[code] * 2^(s - 127): as Transformers' Mxfp4Config
(dequantize=True) computes it (transformers.integrations.mxfp4). Every such value is a bf16 value (two mantissa bits
at most, an exponent within bf16's range), so dequantising to bf16 is exact and holds the weights in half the bytes
of float32 (a float32 model computes on them widened, as on a bf16 checkpoint's). The experts keep the packed blocks
and run on them (folio.models.mxfp4_linear) where that kernel builds, as do a GGUF file's MXFP4 tensors run as stored
(repacked from ggml's order); elsewhere they are dequantised at load.
"""

from __future__ import annotations

import torch

# the value of each 4-bit E2M1 code: sign bit 3, then two exponent bits and one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 [..., rows, groups * 32] from blocks uint8 [..., rows, groups, 16] and scales uint8 [..., rows, groups];
    a ValueError (completing "checkpoint tensor NAME ...") for tensors of other types or shapes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"is MXFP4 with blocks of {blocks.dtype} and scales of {scales.dtype}, expected uint8 both")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"is MXFP4 with blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}, expected "
                         f"[..., groups, {BLOCK // 2}] and [..., groups]")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32], low first
    values = torch.ldexp(table[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(torch.bfloat16)
