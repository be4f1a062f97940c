"""The quantised weight formats, their quantisers, and the torch reference of every quantised matmul.

Formats (the C++ kernels, folio/csrc/cpu_quant_linear.cpp, read the same tensors):
- int8: q int8 [N, K] and scales float32 [N, K / G]: W = q * scale of its group. Symmetric: q in [-127, 127],
  scale = max |W| / 127 over the group. G = K (one scale per output channel) for on-the-fly quantisation; 32
  for GGUF's Q8_0.
- int4: packed uint8 [N, K / 2], scales and offsets float32 [N, K / G]: W = q * scale + offset, q in
  [0, 15], asymmetric (scale = (max - min) / 15, offset = min over the group). In each 32 values of a row,
  byte j holds value j (low nibble) and value j + 16 (high nibble), as llama.cpp's Q4_0 blocks.
- W8A8 activations: each row of x quantised symmetrically to int8 at run time (a scale per token); for layers
  quantised with a rotation, after `rotate`.
- int16 activations (an int8 lm_head's, folio.models.int8_linear): each row of x quantised symmetrically to
  16-bit codes within +-INT16_CODE_MAX, q = 256 * high + low with both signed bytes (low in [-128, 127]), each
  byte's products with the int8 weight summed exactly (the int8 kernels' instructions, twice). The AVX2 block
  kernels (folio.models.int4_blocks, int8_blocks) multiply the same codes whole by int4 or int8 weights
  (w4_int16_linear, w8_int16_grouped_linear).

The references are the definitions the kernels are tested against, and run in their place when the kernel
cannot be built.
"""

from __future__ import annotations

from typing import Optional

import torch

BLOCK = 32  # the kernels' unit along K
INT16_CODE_MAX = 32639  # 127 * 257: the largest 16-bit code whose high byte, (q + 128) >> 8, is at most 127


def quantize_int8(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scales float32 [N, K / group_size]), symmetric per group."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    amax = groups.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (packed uint8 [N, K / 2], scales, offsets float32 [N, K / group_size]), asymmetric
    per group (min to max in 16 steps)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    # the scale and offset on float16's grid (as GGUF's Q4_1 stores them), so that the column blocks of
    # folio.models.int4_blocks hold them exactly; the codes are chosen for the rounded pair
    low = _on_float16_grid(low)
    scales = _on_float16_grid((high - low) / 15)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(n, k)), scales, low


def _on_float16_grid(t: torch.Tensor) -> torch.Tensor:
    """float32 t rounded to the nearest float16 where float16 holds it (beyond its range: as it is)."""
    return torch.where(t.abs() <= torch.finfo(torch.float16).max, t.half().float(), t)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] of values 0..15 -> [N, K / 2]: per 32 values, byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    blocks = q.reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    blocks = packed.reshape(n, half * 2 // BLOCK, 1, BLOCK // 2)
    return torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(n, half * 2)


def dequantize(w: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] of an int8 (offsets None) or int4 layer."""
    q = (w if offsets is None else unpack_int4(w)).float()
    group_size = q.shape[1] // scales.shape[1]
    deq = q.reshape(q.shape[0], scales.shape[1], group_size) * scales[..., None]
    if offsets is not None:
        deq = deq + offsets[..., None]
    return deq.reshape(q.shape)


def weight_only_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ dequantize(W)^T (+ bias), summed in compute_dtype (float64 in tests), returned in x's dtype."""
    y = x.to(compute_dtype) @ dequantize(w, scales, offsets).to(compute_dtype).T
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M]): symmetric per row, rounding half to even."""
    codes, scales = _symmetric_rows(x, 127)
    return codes.to(torch.int8), scales


def _symmetric_rows(x: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float32 integer codes within +-limit, float32 scales [M]), rounding half to even: see
    symmetric_codes."""
    x = x.float()
    return symmetric_codes(x, x.abs().amax(dim=1), limit)


# The smallest largest-|value| a span is quantised for: below it limit / amax would overflow float32.
MIN_SPAN_MAX = 2.0 ** -100


def symmetric_codes(x: torch.Tensor, amax: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (float32) and its spans' largest |value| amax [...] -> (codes round(x * (limit / a)) within
    +-limit, scales a / limit), a = max(amax, MIN_SPAN_MAX); a zero span's codes are 0 and its scale 1. The
    product and the reciprocal are float64: the codes are then x * limit / a rounded once (half to even) but
    where that lies within 2^-37 of a half. The kernels multiply by the reciprocal, one division per span
    (a division per 16 values was 40 % of an unrotated row's time); in float32 its rounding alone moved the
    default model's int8 perplexity by up to 0.25 % (one ulp either way: 26.09, 26.15), as much as the scheme's
    own rounding noise, where float64 leaves nothing to choose."""
    a = amax.clamp(min=MIN_SPAN_MAX)
    zero = amax == 0
    scales = torch.where(zero, torch.ones_like(a), a / limit)
    inverse = torch.where(zero, 1.0, torch.full_like(a, limit, dtype=torch.float64) / a.double())
    return torch.round(x.double() * inverse[..., None]).clamp(-limit, limit).float(), scales


def rotation_block(k: int) -> int:
    """The order of the Walsh-Hadamard blocks a rotated layer with input size k uses: the largest power of two
    that divides k (64 for the default model's 576, 512 for its 1536, 128 for Qwen2-0.5B's 896, all of 4096)."""
    return k & -k


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float32 [M, K]: each block of B = rotation_block(K) values times the Walsh-Hadamard matrix H
    of order B (entries +-1, symmetric, H H = B I), by the fast transform's butterflies (a + b, a - b), log2 B
    stages, in the order the kernel runs them. A W8A8 layer quantised with rotation stores rotate(W) / B, so that
    rotate(x) times it is x W^T: an outlier channel of x spreads over its block before the row is quantised,
    instead of setting the row's scale alone. Measured on the default model (perplexity against bf16's): +3.3 %
    unrotated, +1.04 % in blocks of 32, +0.78 % in blocks of 64, +0.65 % in blocks of rotation_block(K)."""
    v = x.float()
    h = 1
    while h < rotation_block(x.shape[1]):
        pairs = v.reshape(x.shape[0], -1, 2, h)  # values j and j + h of each group of 2h
        v = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return v.reshape(x.shape)


def quantize_rows_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int32 codes within +-INT16_CODE_MAX [M, K], float32 scales [M]): symmetric per row, rounding
    half to even."""
    codes, scales = _symmetric_rows(x, INT16_CODE_MAX)
    return codes.to(torch.int32), scales


def split_int16(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit codes -> (high, low) signed bytes as int32, q = 256 * high + low, low in [-128, 127]."""
    high = torch.div(q + 128, 256, rounding_mode="floor")
    return high, q - 256 * high


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, K / 32]): symmetric per block of 32, rounding half to even."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    q, scales = symmetric_codes(blocks, blocks.abs().amax(dim=2), 127)
    return q.to(torch.int8).reshape(x.shape), scales


def w4a8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int4 W (packed, with scales and offsets per group) times x quantised per block of 32, in x's dtype:
    sum over blocks of (int4 . int8, exact) * x's block scale * W's group scale, plus offsets times x's exact
    group sums (float64 here; the kernel sums in float32)."""
    m, k = x.shape
    q = unpack_int4(w).double()  # [N, K] in 0..15
    xq, xs = quantize_blocks(x)
    dots = torch.einsum("mbj,nbj->mnb", xq.double().reshape(m, -1, BLOCK), q.reshape(q.shape[0], -1, BLOCK))
    per_group = k // scales.shape[1] // BLOCK
    block_scales = scales.double().repeat_interleave(per_group, dim=1)  # [N, K / 32]
    y = (dots * xs.double()[:, None, :] * block_scales[None]).sum(dim=2)
    y = y + x.double().reshape(m, scales.shape[1], -1).sum(dim=2) @ offsets.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def w8a8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor],
                rotated: bool = False) -> torch.Tensor:
    """Dynamic per-token W8A8: exact integer sums, then float32(sum) * (x scale * w scale) (+ bias); x's rows are
    rotated first for a weight quantised with rotation."""
    xq, sx = quantize_rows(rotate(x) if rotated else x)
    acc = (xq.long() @ w.long().T).float()
    y = acc * (sx[:, None] * scales.reshape(1, -1))
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def _int16_group_products(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x quantised per row to 16-bit codes times integer codes q [N, K] with scales [N, K / G], float64 [M, N]: per
    group the exact integer sum of q's codes times x's, times the group's scale and x's row scale."""
    m, k = x.shape
    xq, sx = quantize_rows_int16(x)
    group = k // scales.shape[1]
    dots = torch.einsum("mgj,ngj->mng", xq.double().reshape(m, -1, group), q.double().reshape(q.shape[0], -1, group))
    return (dots * scales.double()[None]).sum(dim=2) * sx.double()[:, None]


def w4_int16_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int4 W (packed, with scales and offsets per group) times x quantised per row to 16-bit codes, in x's
    dtype: `_int16_group_products` plus offsets times x's exact group sums (float64 here; the float32 block
    kernel sums in float32)."""
    y = _int16_group_products(x, unpack_int4(w), scales)
    y = y + x.double().reshape(x.shape[0], scales.shape[1], -1).sum(dim=2) @ offsets.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def w8_int16_grouped_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                            bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 W [N, K] with scales per group (one per row included) times x quantised per row to 16-bit codes, in
    x's dtype: `_int16_group_products` (float64 here; the AVX2 block kernel, folio.models.int8_blocks, sums in
    float32 per group and per 256 pairs of a longer one)."""
    y = _int16_group_products(x, w, scales)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def w8_int16_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 W [N, K] with one scale per row times x quantised per row to 16-bit codes, in x's dtype: the exact
    integer sums of the codes' high bytes and low bytes with W, combined in float32 as 256 * float(high sum) +
    float(low sum) (the product by 256 exact, the sum rounded once), then scaled as W8A8 (+ bias)."""
    q, sx = quantize_rows_int16(x)
    high, low = split_int16(q)
    wt = w.long().T
    acc = (high.long() @ wt).float() * 256 + (low.long() @ wt).float()
    y = acc * (sx[:, None] * scales.reshape(1, -1))
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)
