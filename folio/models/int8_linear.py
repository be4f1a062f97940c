"""int8 weights: one symmetric scale per output channel, quantised on the fly (folio.models.quantized_linear).

Scheme "int8" multiplies the int8 weight with float activations (W8A16): reading the weight is the cost of
decode, and 8 bits halve it against bf16. Scheme "w8a8" also quantises each activation row to int8 at run
time (dynamic, per token) and sums int8 products exactly in int32: four times the multiply-adds per
instruction of float32 FMAs, at the cost of the activations' rounding. Measured on AVX2 (README,
"Quantisation"), W8A8 is faster at every batch size, one row included (W8A16 there is bound by widening int8
to float32, not by memory), so w8a8 uses it throughout and int8 is the scheme for accuracy. On a CPU with
AMX-INT8, W8A8 batches of many rows go to oneDNN's int8 GEMM on its tiles instead (folio.models.onednn_int8).
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import onednn_int8, quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int8
from folio.models.quantized_linear import QuantizedLinearMethod


class Int8LinearMethod(QuantizedLinearMethod):
    def __init__(self, int8_activations: bool = False, onednn: Optional[bool] = None) -> None:
        """onednn: W8A8 batches of onednn_int8.MIN_ROWS rows or more in oneDNN's int8 GEMM (default: where the
        CPU has AMX-INT8)."""
        self.int8_activations = int8_activations
        self.onednn = int8_activations and (onednn_int8.usable() if onednn is None else onednn)

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        layer.onednn_weight = None  # the weight in oneDNN's layout, once loaded (self.onednn only)

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        if self.onednn:
            layer.onednn_weight = onednn_int8.prepack(layer.weight.detach(), layer.weight_scale.view(-1))

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size), torch.int8, 1

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        q, scales = quantize_int8(w, w.shape[1])
        return q, scales, None

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.onednn_weight is not None and x.shape[0] >= onednn_int8.MIN_ROWS:
            return onednn_int8.linear(x, layer.onednn_weight, layer.bias)
        if self.int8_activations:
            return quant_kernels.w8a8_linear(x, layer.weight, layer.weight_scale.view(-1), layer.bias)
        return self.weight_only(layer, x)
