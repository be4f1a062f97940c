"""The dense CPU linear method: unquantised weights, each batch on the fastest CPU kernel for its size.

In bf16 and float32 the weight is reordered once, after loading, into oneDNN's blocked layout, and the plain one
is freed (a tied lm_head's embedding then looks its tokens up in the packed copy: `weight_rows`): plain F.linear
reorders a bf16 weight on every call, which costs 10-40% of a decode step's matmuls, and MKL packs a float32 one
on every call of two rows or more. Batches of at most small_batch_gemm.MAX_ROWS rows go to a kernel that reads
that same packed weight in place, faster than oneDNN's GEMM at those sizes; one copy of the weight serves every
batch size. In float32 (the default dtype on CPUs without fast bf16), oneDNN's GEMM on the packed weight against
MKL's on the plain one, 0.5B Qwen2's layers on 2 cores of a Zen 3 EPYC: 1.1-1.6x as fast at a W1 decode step's 62
rows, 0.6-1.2x at a prefill step's 1852; W1 1.09-1.23x, passes alternating (README, "Performance").

A SwiGLU gate/up in bf16, where the AMX tiles take its small batches, is packed in the gated layout
(folio.models.gated_layout): batches on the tiles get SiLU-and-mul's result from the kernel's epilogue, which
writes half the product and skips the op's pass over it; the other batches (the vector loop's, oneDNN's) take the
op over their product in that layout, oneDNN's piece by piece (SILU_PIECE_ROWS) while each piece is in cache. The
layer's product is then SiLU-and-mul's, whichever way it is asked for.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from folio.models import gated_layout, small_batch_gemm
from folio.models.layers import silu_and_mul
from folio.models.linear import Linear, LinearMethod

# oneDNN's blocked weight layout is chosen for a batch size; decode batches of tens of requests dominate.
PACK_FOR_BATCH = 64
# A gated gate/up's batches on oneDNN go in pieces of at most this many rows, each piece's SiLU-and-mul taken
# while its product is still in cache. A 2048-token prefill step's whole product (0.5B Qwen2: 40 MB) went to
# memory and back: on 2 cores of an Emerald Rapids Xeon the layer took 12.1-14.4 ms whole against 10.9-11.8 in
# pieces of 512 rows, about oneDNN's product alone (10.2-10.9); pieces of 1024 ran as 512, of 256 12.5, of 128 15.
SILU_PIECE_ROWS = 512


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN's linear on a packed weight: float32 wherever oneDNN is built in, bf16 on a CPU that has it (the
    reorder refuses CPUs without AVX-512 or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseLinearMethod(LinearMethod):
    """Per layer: `packed` (the weight in oneDNN's layout, or None), `small_batch_weight` (what the small-batch
    kernel reads: a view of `packed`; None where it cannot serve) and `silu_table` (a gated gate/up's:
    fused_ops.bf16_silu_table, which the epilogue looks its gates up in; else None). A float32 weight is packed
    only where the kernel reads oneDNN's layout, and stays plain on MKL elsewhere."""

    plain_weights = True

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size)
        layer.bias = layer.row_parameter() if layer.with_bias else None
        layer.packed = None
        layer.small_batch_weight = None
        layer.silu_table = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Switch to the packed weight and free the plain one unless the embedding needs it (float32: where the
        small-batch kernel reads the packed one)."""
        if not (can_prepack(layer.weight.dtype) and layer.weight.is_cpu):
            return
        weight = layer.weight.detach()
        table = gated_silu_table(layer)
        if table is not None:
            layer.packed, layer.small_batch_weight = pack(gated_layout.interleave_gated(weight))
            blocks = layer.small_batch_weight
            if blocks is not None and blocks.blocks.shape[2] == gated_layout.GATED_RUN:
                layer.silu_table = table
        if layer.silu_table is None:
            layer.packed, layer.small_batch_weight = pack(weight)
        if layer.small_batch_weight is None and weight.dtype == torch.float32:
            layer.packed = None  # one row on oneDNN took twice MKL's time on the plain weight: keep that one
            return
        if not layer.tied:
            layer.weight = None

    def weight_rows(self, layer: Linear) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The packed copy's rows (small_batch_gemm.weight_rows), where the kernel reads it and its rows are the
        weight's in order (not the gated layout's)."""
        if layer.small_batch_weight is None or layer.silu_table is not None:
            return None
        return functools.partial(small_batch_gemm.weight_rows, layer.small_batch_weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.silu_table is not None:  # a gated weight's product is SiLU-and-mul's
            return self.apply_silu_and_mul(layer, x)
        return self.product(layer, x)

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.silu_table is None:
            return silu_and_mul(self.product(layer, x))
        out = small_batch_gemm.linear_silu_and_mul(x, layer.small_batch_weight, layer.silu_table)
        if out is not None:
            return out
        if x.dim() != 2 or x.shape[0] <= SILU_PIECE_ROWS:
            return gated_layout.silu_and_mul_gated(self.product(layer, x))
        out = x.new_empty(x.shape[0], layer.output_size // 2)
        pieces = -(-x.shape[0] // SILU_PIECE_ROWS)
        rows = -(-x.shape[0] // pieces)  # pieces of equal size (the last may be smaller)
        for r in range(0, x.shape[0], rows):
            gated_layout.silu_and_mul_gated(self.product(layer, x[r:r + rows]), out=out[r:r + rows])
        return out

    def product(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) on the kernel for the batch's size; a gated weight's columns in its layout."""
        if layer.small_batch_weight is not None and small_batch_gemm.serves(x):
            return small_batch_gemm.linear(x, layer.small_batch_weight, layer.bias)
        if layer.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        return nn.functional.linear(x, layer.weight, layer.bias)

    def apply_argmax(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """Batches on the small-batch kernel's AMX tiles take the argmax in its epilogue, the product never
        written (a greedy step's lm_head); others the argmax of apply's product."""
        weight = layer.small_batch_weight
        tokens = None if weight is None else small_batch_gemm.linear_argmax(x, weight, layer.bias)
        return tokens if tokens is not None else super().apply_argmax(layer, x)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, Optional[small_batch_gemm.PackedWeight]]:
    """A bf16 or float32 weight in oneDNN's layout, and the small-batch kernel's view of it (None where it cannot
    read it)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_BATCH)
    return packed, small_batch_gemm.packed_blocks(packed, weight)


def gated_silu_table(layer: Linear) -> Optional[torch.Tensor]:
    """The silu table for a bf16 SwiGLU gate/up (no bias) whose small batches the AMX tiles take here, so that it
    goes in the gated layout (gated_layout.silu_table); None for every other layer."""
    if not (layer.silu_and_mul and layer.bias is None and layer.weight.dtype == torch.bfloat16
            and small_batch_gemm.AMX_ROWS and small_batch_gemm.amx_available() and layer.input_size % 32 == 0):
        return None
    return gated_layout.silu_table(layer.output_size)
