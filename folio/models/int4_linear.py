"""int4 weights: asymmetric groups of 128 values along K (32 where K is not a multiple of 128), quantised on
the fly (folio.models.quantized_linear); activations stay in floating point (weight-only, W4A16).

A weight is a quarter of its bf16 size plus 8 bytes of scale and offset per group, so bandwidth-bound decode
reads about a quarter as much.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int4
from folio.models.quantized_linear import QuantizedLinearMethod

GROUP_SIZES = (128, 32)  # the first that divides K


def group_size(input_size: int) -> int:
    return next(g for g in GROUP_SIZES if input_size % g == 0)


class Int4LinearMethod(QuantizedLinearMethod):
    asymmetric = True

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size // 2), torch.uint8, input_size // group_size(input_size)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return quantize_int4(w, group_size(w.shape[1]))

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant_kernels.weight_only_linear(x, layer.weight, layer.weight_scale, layer.weight_offset, layer.bias)
