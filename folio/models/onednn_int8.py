"""W8A8 matmuls of many rows in oneDNN's int8 GEMM: the path to AMX-INT8 tiles.

folio's own W8A8 kernel (folio/csrc/cpu_quant_linear.cpp) sums int8 products with VNNI's vpdpbusd (or AVX2's
vpmaddubsw): 64 products per instruction, a quarter of what AMX-BF16 tiles do for bf16, so on an AMX machine a
prefill in int8 would lose to the same prefill in bf16. oneDNN's int8 GEMM (PyTorch's `onednn::qlinear_pointwise`,
the x86 quantisation backend's op) runs the products on AMX-INT8 tiles there, twice AMX-BF16's rate.

The arithmetic is the one of folio.models.quant_reference.w8a8_linear: the activation rows are quantised per
token as the kernel does (`quantize_rows`), oneDNN takes their int8 codes with a scale of 1 and the weight with
its per-channel scales, so its float32 result is each exact int32 sum times the weight's scale; each row is then
multiplied by its own token scale (oneDNN has one activation scale per tensor) and the bias added.

Only where the CPU has AMX-INT8 (`usable`): without VNNI, oneDNN's int8 GEMM pairs products in int16 with
saturation (vpmaddubsw), exact only for weights within 7 bits, and with VNNI alone folio's kernel does the same
products. Batches of fewer than MIN_ROWS rows stay on folio's kernel, which reads the weight once per call.
Tests run this path on any CPU with weights within 7 bits. Not yet measured on an AMX machine (the rule is a
first guess): scripts/gpu_check.sh times W1 in w8a8 against bf16 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from folio.models.quant_reference import quantize_rows
from folio.platforms.cpu_features import has_amx_int8

# the weight is packed for a batch of this many rows (prefill chunks and decode batches of tens of requests)
_PACK_FOR_ROWS = 64
MIN_ROWS = 16


def available() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def usable() -> bool:
    """Whether W8A8 layers should use it here: a CPU with AMX-INT8 tiles (see the module's docstring)."""
    return has_amx_int8() and available()


@dataclass
class PackedInt8Weight:
    """An int8 weight [N, K] in oneDNN's layout, with its float32 per-channel scales [N]."""

    packed: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor  # int64 [N] of zeros: the weights are symmetric


def prepack(weight: torch.Tensor, scales: torch.Tensor) -> PackedInt8Weight:
    """weight int8 [N, K], scales float32 [N]."""
    packed = torch.ops.onednn.qlinear_prepack(weight, [_PACK_FOR_ROWS, weight.shape[1]])
    return PackedInt8Weight(packed, scales.contiguous(), torch.zeros(weight.shape[0], dtype=torch.int64))


def linear(x: torch.Tensor, weight: PackedInt8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] quantised per row to int8, times the weight, (+ bias float32), in x's dtype."""
    codes, row_scales = quantize_rows(x)
    y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, weight.packed, weight.scales, weight.zero_points, None,
                                           1.0, 0, torch.float32, "none", [], "")
    y.mul_(row_scales[:, None])
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype)
