"""oneDNN's packed weights, read in place by folio's kernels for small batches, so a layer keeps one copy.

oneDNN packs a weight [N, K] for its GEMM into blocks of `width` output columns, each [K' / group][width][group]
(K' >= K, padded; `group` consecutive values along K side by side: 2 for bf16, the pairs vdpbf16ps multiplies, 4
for int8, vpdpbusd's quads), the last block's columns past N padding, possibly followed by data of its own (the
int8 weights' compensation). It does not publish the layout it picks per CPU and shape, so `vnni_blocks`
recognises it: the first, a middle and the last block must hold the plain weight's values where that layout puts
them. Any other layout is refused, and the caller keeps a plain copy instead.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

# oneDNN's blocked weight layout is chosen for a batch size; decode batches of tens of requests dominate.
PACK_FOR_BATCH = 64
BLOCK_WIDTHS = (64, 48, 32, 16)
# values side by side along K in oneDNN's blocks of each float dtype: bf16's pairs (vdpbf16ps's), float32's one by one
GROUPS = {torch.bfloat16: 2, torch.float32: 1}
# K' candidates: K rounded up to the group, or to one of these (oneDNN's K blocking)
K_PADDINGS = (1, 16, 32, 64)


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN's linear on a packed weight: float32 wherever oneDNN is built in, bf16 on a CPU that has it (the
    reorder refuses CPUs without AVX-512 or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def raw_bytes(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The buffer of a oneDNN tensor as a flat tensor of dtype that holds the oneDNN tensor alive."""
    buffer = (ctypes.c_char * torch.ops.mkldnn._nbytes(packed)).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed
    return torch.frombuffer(buffer, dtype=dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _block_matches(blocks: torch.Tensor, weight: torch.Tensor, index: int) -> bool:
    width, group = blocks.shape[2], blocks.shape[3]
    rows = weight[index * width:(index + 1) * width]
    expected = rows.reshape(rows.shape[0], -1, group).transpose(0, 1)  # [K / group, columns, group]
    return torch.equal(blocks[index, :expected.shape[0], :rows.shape[0]], expected)


def vnni_blocks(packed: torch.Tensor, weight: torch.Tensor, group: int,
                widths: tuple[int, ...] = BLOCK_WIDTHS) -> Optional[torch.Tensor]:
    """oneDNN's packed copy of weight [N, K] (K % group == 0) as blocks [ceil(N / width), K' / group, width, group]
    of weight's dtype, width one of `widths` (those the caller's kernel reads), viewing oneDNN's buffer; None if
    it is laid out otherwise."""
    if packed.layout != torch._mkldnn or weight.dim() != 2 or weight.shape[1] % group:
        return None
    raw = raw_bytes(packed, weight.dtype)
    n, k = weight.shape
    for width in widths:
        num_blocks = -(-n // width)
        for padded_k in sorted({_round_up(k, max(p, group)) for p in K_PADDINGS}):
            size = num_blocks * width * padded_k
            if size > raw.numel():
                continue
            blocks = raw[:size].view(num_blocks, padded_k // group, width, group)
            if all(_block_matches(blocks, weight, i) for i in {0, num_blocks // 2, num_blocks - 1}):
                return blocks
    return None
