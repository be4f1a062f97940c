"""int8 weights: one symmetric scale per output channel, quantised on the fly (folio.models.quantized_linear).

Scheme "int8" (W8A8) also quantises each activation row to int8 at run time (dynamic, per token) and sums int8
products exactly in int32: twice bf16's multiply-adds per instruction with VNNI, four times float32 FMAs' on
AVX2, at the cost of the activations' rounding. It is the faster way at every batch size measured (README,
"Low precision"), one row included, so it runs throughout: folio's kernel for a row or two, oneDNN's int8 GEMM
for more where the CPU has VNNI or AMX-INT8 (folio.models.onednn_int8), the kernel again elsewhere.

Per-token scales let one outlier channel of a row (LLMs have a few, hundreds of times the others) set the whole
row's scale, and perplexity suffered (+3.3 % on the default model). So on-the-fly W8A8 layers are rotated, as
QuaRot does: the weight is stored as rotate(W) / B (folio.models.quant_reference.rotate: each block of B input
channels times the Walsh-Hadamard matrix of order B, B the largest power of two dividing K) and each activation
row is rotated the same way before it is quantised, which leaves x W^T unchanged and spreads an outlier over its
block (bf16: +0.65 %; +1.04 % in blocks of 32). Pre-quantised checkpoints
(compressed-tensors) run as stored, unrotated.

Scheme "w8a16" and the lm_head of schemes "int4" and "int4-g128" (where it is not the rescored one of
folio.models.rescored_head) take their activations as 16-bit integers per row
(`int16_activations`, quant_reference.w8_int16_linear): each code's two bytes times the int8 weight by the W8A8
instructions, exact in int32, so their results are as close to bf16's as float activations' (the default model's
perplexity in bf16: "w8a16" 25.9674 against 25.9753 with float activations and 25.9392 unquantised; "int4"
25.9094 against 25.9044 with a weight-only head) at W8A8's cost where memory bounds it (one row of Qwen2-0.5B's
151936 x 896 head on Zen 4: 3.54 ms against the W8A8 kernel's 3.42 and the weight-only kernel's 3.83) and twice
W8A8's GEMM in larger batches (two int8 GEMMs: 64 rows 33 ms against 15.5, and the weight-only head's
dequantised GEMM 54). Scheme "int8" keeps its W8A8 head: W1 would lose 10 % for 0.04 % of perplexity. CPUs
without VNNI or AMX-INT8 run these layers weight-only: with AVX-512, the int8 weight times float activations
(bound on the CPUs measured by widening int8 to float rather than by memory); with AVX2 alone, float32 layers
keep their weight as column blocks and multiply it with x's 16-bit codes (folio.models.int8_blocks).
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import int8_blocks, onednn_int8, quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int8, rotate, rotation_block
from folio.models.quantized_linear import QuantizedLinearMethod


class Int8LinearMethod(QuantizedLinearMethod):
    def __init__(self, int8_activations: bool = False, rotated: bool = False, onednn: Optional[bool] = None,
                 int16_activations: bool = False) -> None:
        """int8_activations: W8A8 (else W8A16); rotated: quantise rotate(W) / B and rotate x (W8A8 only);
        int16_activations: x quantised per row to int16 (unrotated), where the CPU has VNNI or AMX-INT8;
        onednn: W8A8 and int16 layers in oneDNN's packed layout, for its int8 GEMM from a few rows on and folio's
        kernel that reads it below (default: where the CPU has VNNI or AMX-INT8; folio.models.onednn_int8)."""
        if rotated and not int8_activations:
            raise ValueError("a rotated int8 layer quantises its activations (int8_activations=True)")
        if int8_activations and int16_activations:
            raise ValueError("int8_activations and int16_activations exclude each other")
        self.int8_activations = int8_activations
        self.int16_activations = int16_activations
        self.rotated = rotated
        self.onednn = (int8_activations or int16_activations) and (onednn_int8.usable() if onednn is None else onednn)

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        layer.onednn_weight = None  # the weight in oneDNN's layout, once loaded (self.onednn only)
        layer.int8_blocks = None  # the weight in column blocks, once loaded (weight-only float32 layers on AVX2)

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        if self.onednn:
            # a SwiGLU gate/up of a bf16 model: SiLU-and-mul in the epilogue where the CPU runs every batch there
            gated = layer.silu_and_mul and layer.bias is None and layer.params_dtype is torch.bfloat16
            layer.onednn_weight = onednn_int8.prepack(layer.weight.detach(), layer.weight_scale.view(-1), gated)
            if layer.onednn_weight.blocks is not None:
                layer.weight = None  # every batch reads oneDNN's copy: the layer keeps one
        elif (not self.int8_activations and int8_blocks.available(layer.params_dtype)
              and int8_blocks.packable(layer.input_size, layer.weight_scale)):
            # every batch reads the blocks (folio.models.int8_blocks): the layer keeps only them
            layer.int8_blocks = int8_blocks.pack(layer.weight.detach(), layer.weight_scale)
            layer.weight = layer.weight_scale = None

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size), torch.int8, 1

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        q, scales = quantize_int8(rotate(w) / rotation_block(w.shape[1]) if self.rotated else w, w.shape[1])
        return q, scales, None

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed = layer.onednn_weight
        if packed is None or packed.silu_table is None:
            return super().apply_silu_and_mul(layer, x)
        return self.apply(layer, x)  # a gated weight's product is SiLU-and-mul's already

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.int8_blocks is not None:
            return int8_blocks.linear(x, layer.int8_blocks, layer.bias)
        packed = layer.onednn_weight
        if self.int16_activations and packed is not None:
            return onednn_int8.linear_int16(x, packed, layer.bias)
        if packed is not None and (packed.blocks is not None or x.shape[0] >= packed.min_rows):
            return onednn_int8.linear(x, packed, layer.bias, self.rotated)
        if self.int8_activations:
            return quant_kernels.w8a8_linear(x, layer.weight, layer.weight_scale.view(-1), layer.bias, self.rotated)
        return self.weight_only(layer, x)
