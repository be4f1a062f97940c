"""int4 weights: asymmetric groups of 32 values along K (scheme "int4"), or of 128 where K allows
("int4-g128"), quantised on the fly (folio.models.quantized_linear); activations stay in floating point
(weight-only, W4A16). Scheme "w4a8" quantises the activations too, to int8 per block of 32 values at run time,
and sums the 4-bit x 8-bit products exactly in int32 (llama.cpp's Q4 x Q8 recipe): on AVX2 the weight-only
kernel is bound by widening 4 bits to float32, and W4A8 decodes twice as fast (README, "Low precision"), at
the cost of the activations' rounding. Prefill-sized batches run the dense GEMM on the dequantised weight
in both schemes.

A weight takes half a byte per value plus a scale and an offset per group, both on float16's grid: in float32
(0.75 bytes per value in groups of 32, 0.5625 in groups of 128, against bf16's 2), or in float16 (0.625,
0.53) where a bf16 model on AVX512-BF16 keeps the weight as column blocks (folio.models.int4_blocks; w4a8
keeps the row-major format its kernel reads). Groups of 32 are what llama.cpp's 4-bit types use; on
SmolLM2-135M groups of 128 cost 13% perplexity where 32 cost nothing (README, "Quantisation").
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import int4_blocks, quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import BLOCK, quantize_int4
from folio.models.quantized_linear import QuantizedLinearMethod, dequantize_min_rows

class Int4LinearMethod(QuantizedLinearMethod):
    asymmetric = True

    def __init__(self, group_size: int = BLOCK, int8_activations: bool = False) -> None:
        self.preferred_group_size = group_size
        self.int8_activations = int8_activations

    def group_size(self, input_size: int) -> int:
        """The preferred size where it divides K, else the kernels' block (K is a multiple of it)."""
        return self.preferred_group_size if input_size % self.preferred_group_size == 0 else BLOCK

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size // 2), torch.uint8, input_size // self.group_size(input_size)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return quantize_int4(w, self.group_size(w.shape[1]))

    def process_weights_after_loading(self, layer: Linear) -> None:
        """A weight-only layer keeps its weight only as column blocks (folio.models.int4_blocks) where a block
        kernel serves the model's dtype: bf16 on AVX512-BF16 (read four times as fast as the row-major format),
        float32 with AVX2 and no AVX-512 (three times; its kernel rounds x to 16-bit codes, folio.models.int4_blocks)."""
        super().process_weights_after_loading(layer)
        if not self.int8_activations and int4_blocks.available(layer.params_dtype):
            layer.int4_blocks = int4_blocks.pack(layer.weight.detach(), layer.weight_scale, layer.weight_offset,
                                                 layer.params_dtype)
            if layer.int4_blocks is not None:
                layer.weight = layer.weight_scale = layer.weight_offset = None

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        blocks: Optional[int4_blocks.Int4Blocks] = getattr(layer, "int4_blocks", None)
        if blocks is not None:
            if int4_blocks.runs_kernel(x):
                return int4_blocks.linear(x, blocks, layer.bias)
            return int4_blocks.dense_linear(x, blocks, layer.bias)
        if self.int8_activations and x.shape[0] < dequantize_min_rows(x.dtype):
            return quant_kernels.w4a8_linear(x, layer.weight, layer.weight_scale, layer.weight_offset, layer.bias)
        return self.weight_only(layer, x)
