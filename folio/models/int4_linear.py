"""int4 weights: asymmetric groups of 32 values along K (scheme "int4"), or of 128 where K allows
("int4-g128"), quantised on the fly (folio.models.quantized_linear); activations stay in floating point
(weight-only, W4A16).

A weight takes half a byte per value plus 8 bytes of float32 scale and offset per group: 0.75 bytes per value
in groups of 32, 0.5625 in groups of 128, against bf16's 2. Groups of 32 are what llama.cpp's 4-bit types use;
on SmolLM2-135M groups of 128 cost 13% perplexity where 32 cost nothing (README, "Quantisation").
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models.linear import Linear
from folio.models.quant_reference import BLOCK, quantize_int4
from folio.models.quantized_linear import QuantizedLinearMethod

class Int4LinearMethod(QuantizedLinearMethod):
    asymmetric = True

    def __init__(self, group_size: int = BLOCK) -> None:
        self.preferred_group_size = group_size

    def group_size(self, input_size: int) -> int:
        """The preferred size where it divides K, else the kernels' block (K is a multiple of it)."""
        return self.preferred_group_size if input_size % self.preferred_group_size == 0 else BLOCK

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size // 2), torch.uint8, input_size // self.group_size(input_size)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return quantize_int4(w, self.group_size(w.shape[1]))

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.weight_only(layer, x)
