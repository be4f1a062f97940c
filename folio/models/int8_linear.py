"""int8 weights: one symmetric scale per output channel, quantised on the fly (folio.models.quantized_linear).

A batch of few rows multiplies the int8 weight with float activations (W8A16: reading the weight is the
cost, and 8 bits halve it against bf16); larger batches also quantise each activation row to int8 at run
time (W8A8, dynamic per token) and sum int8 products exactly in int32, four times the multiply-adds per
instruction of float32 FMAs. Where the switch lies was measured (README, "Quantisation"): W8A8_MIN_ROWS.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int8
from folio.models.quantized_linear import QuantizedLinearMethod

# Batches of at least this many rows run W8A8 (measured with benchmarks/quant_linear_bench.py).
W8A8_MIN_ROWS = 2


class Int8LinearMethod(QuantizedLinearMethod):
    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size), torch.int8, 1

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        q, scales = quantize_int8(w, w.shape[1])
        return q, scales, None

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= W8A8_MIN_ROWS:
            return quant_kernels.w8a8_linear(x, layer.weight, layer.weight_scale.view(-1), layer.bias)
        return quant_kernels.weight_only_linear(x, layer.weight, layer.weight_scale, None, layer.bias)
