"""Linear methods whose weights are quantised on the fly as the checkpoint loads (int8, int4).

Each checkpoint tensor, a whole weight or one shard of a fused q/k/v or gate/up layer, is quantised the moment
it is handed to its parameter's weight loader, into that shard's rows: scales are per row (and per group
along K), so shards quantise independently, and no float copy of the model is ever whole in memory. A tied
lm_head is the embedding's float weight while loading; it gets its own quantised copy afterwards (the
embedding lookup keeps the float table: in a float32 model, a bf16 checkpoint's table stays bf16,
weight_loader.keep_bf16_tensors, since the lookup widens its rows exactly and quantising reads it in float32).

A subclass says how a float weight is quantised (`quantize`: the formats of folio.models.quant_reference)
and how a batch is multiplied (`apply`).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Optional

import torch
from torch import nn

from folio.models import packed_scratch, quant_kernels
from folio.models.linear import Linear, LinearMethod
from folio.models.weight_loader import ShardId, copy_checked, keep_bf16_tensors, set_weight_loader
from folio.platforms.cpu_features import has_fast_bf16

# Rows quantised at a time: bounds the float32 temporaries of quantising a large tensor (an embedding).
_ROWS_PER_CHUNK = 4096
# From this many rows of x, a weight-only layer dequantises its weight (in C++, to x's dtype) and runs the dense
# GEMM on it. float32: measured on AVX2 (one 9728 x 896 layer, one thread), MKL's float32 GEMM takes 200 ms at
# 256 rows where the weight-only kernel takes 269 (int8) and 644 (int4), and dequantising 1.7 ms, once per call.
# bf16: measured on Zen 4 (AVX512-BF16, 2 threads, the same layer), oneDNN's bf16 GEMM on the weight dequantised
# for the call wins from 8 rows (int8: 0.9 ms against the kernel's 1.2 at 16 rows; int4: at 8 rows), so batched
# decode does not pay the kernel's per-row cost (at 62 rows it took 4.7 ms in int8, 8.0 in int4).
DEQUANTIZE_MIN_ROWS = {torch.float32: 128, torch.bfloat16: 8}


@functools.cache
def dequantize_min_rows(dtype: torch.dtype) -> int:
    """Batches of this many rows of x in dtype run the dense GEMM on the dequantised weight (decided once per
    dtype: every quantised matmul asks)."""
    return DEQUANTIZE_MIN_ROWS[torch.bfloat16 if dtype == torch.bfloat16 and has_fast_bf16() else torch.float32]


class QuantizedLinearMethod(LinearMethod):
    """layer.weight: the packed weight (a parameter the checkpoint fills through `_load`); layer.weight_scale
    and, for asymmetric formats, layer.weight_offset: float32 [N, groups] buffers; layer.bias: float32."""

    asymmetric = False  # whether the format has offsets (W = q * scale + offset)

    @abstractmethod
    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        """(shape of the packed weight of `rows` rows, its dtype, number of groups along K)."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Float rows [n, K] -> (packed rows, scales [n, groups], offsets [n, groups] or None)."""

    def create_weights(self, layer: Linear) -> None:
        shape, dtype, groups = self.packed_shape(layer.output_size, layer.input_size)
        if not layer.tied:
            layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_loader(layer.weight, lambda param, tensor, shard_id: self._load(layer, tensor, shard_id),
                              layer.shards)
        elif layer.params_dtype == torch.float32:
            keep_bf16_tensors(layer.weight)  # the embedding's table: half the bytes for the same values
        # float32 whatever the model's dtype (the kernels' format; bf16 would round the scales)
        layer.register_buffer("weight_scale", torch.empty(layer.output_size, groups, dtype=torch.float32),
                              persistent=False)
        offsets = torch.empty(layer.output_size, groups, dtype=torch.float32) if self.asymmetric else None
        layer.register_buffer("weight_offset", offsets, persistent=False)
        layer.bias = layer.row_parameter() if layer.with_bias else None

    def _load(self, layer: Linear, tensor: torch.Tensor, shard_id: ShardId) -> None:
        """Weight loader: quantise the shard's float rows into its rows of the packed weight and scales."""
        first, rows = layer.shard_extent(shard_id)
        if tuple(tensor.shape) != (rows, layer.input_size):
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {(rows, layer.input_size)}")
        self._quantize_into(layer, tensor, first)

    def _quantize_into(self, layer: Linear, w: torch.Tensor, first: int) -> None:
        for start in range(0, w.shape[0], _ROWS_PER_CHUNK):
            chunk = w[start:start + _ROWS_PER_CHUNK]
            packed, scales, offsets = self.quantize(chunk)
            row = first + start
            copy_checked(layer.weight.data.narrow(0, row, chunk.shape[0]), packed)
            layer.weight_scale.narrow(0, row, chunk.shape[0]).copy_(scales)
            if offsets is not None:
                layer.weight_offset.narrow(0, row, chunk.shape[0]).copy_(offsets)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """A tied layer quantises the embedding's weight into a packed weight of its own; biases become float32
        (the kernels add them in float32)."""
        if layer.tied:
            embedding = layer.weight.detach()
            shape, dtype, _ = self.packed_shape(layer.output_size, layer.input_size)
            layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            self._quantize_into(layer, embedding, 0)
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's flattened batch: no reshapes (microseconds each, per layer per step)
            return self.matmul(layer, x)
        y = self.matmul(layer, x.reshape(-1, layer.input_size))
        return y.reshape(*x.shape[:-1], y.shape[-1])  # (a gated int8 layer's product is half its output_size)

    @abstractmethod
    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""

    @staticmethod
    def weight_only(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x times the layer's weight in x's dtype: the weight-only kernel, or for a prefill-sized x the dense
        GEMM on the dequantised weight (in bf16: written into the packed scratch of the layer's shape,
        folio.models.packed_scratch)."""
        if x.shape[0] >= dequantize_min_rows(x.dtype):
            w, scales, offsets = layer.weight, layer.weight_scale, layer.weight_offset
            dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32  # the kernel's two
            write = (lambda blocks: quant_kernels.dequantize_packed(w, scales, offsets, blocks)) \
                if quant_kernels.available() else None
            return packed_scratch.linear(x, layer.output_size, write,
                                         lambda: quant_kernels.dequantize(w, scales, offsets, dtype), layer.bias)
        return quant_kernels.weight_only_linear(x, layer.weight, layer.weight_scale, layer.weight_offset, layer.bias)
