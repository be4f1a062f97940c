"""The dense CPU linear method: unquantised weights, each batch on the fastest CPU kernel for its size.

In bf16 and float32 the weight is reordered once, after loading, into oneDNN's blocked layout, and the plain one
is freed (a tied lm_head's embedding then looks its tokens up in the packed copy: `weight_rows`): plain F.linear
reorders a bf16 weight on every call, which costs 10-40% of a decode step's matmuls, and MKL packs a float32 one
on every call of two rows or more. Batches of at most small_batch_gemm.MAX_ROWS rows go to a kernel that reads
that same packed weight in place, faster than oneDNN's GEMM at those sizes; one copy of the weight serves every
batch size. In float32 (the default dtype on CPUs without fast bf16), oneDNN's GEMM on the packed weight against
MKL's on the plain one, 0.5B Qwen2's layers on 2 cores of a Zen 3 EPYC: 1.1-1.6x as fast at a W1 decode step's 62
rows, 0.6-1.2x at a prefill step's 1852; W1 1.09-1.23x, passes alternating (README, "Performance"). A float32
weight whose values are all bf16 ones (a bf16 checkpoint run in float32) keeps only the kernel's blocks, in bf16,
and serves every batch from them (folio.models.bf16_valued): half the memory, and small batches read half the
bytes.

A SwiGLU gate/up in bf16, where the AMX tiles take its small batches, is packed in the gated layout
(folio.models.gated_layout): batches on the tiles get SiLU-and-mul's result from the kernel's epilogue, which
writes half the product and skips the op's pass over it; the other batches (the vector loop's, oneDNN's) take the
op over their product in that layout. The layer's product is then SiLU-and-mul's, whichever way it is asked for.
Every gate/up takes a large batch piece by piece (SILU_PIECE_ROWS), each piece's op while it is in cache.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from folio.models import bf16_valued, gated_layout, small_batch_gemm
from folio.models.layers import silu_and_mul
from folio.models.linear import Linear, LinearMethod
from folio.models.onednn_layout import PACK_FOR_BATCH, can_prepack
from folio.models.weight_loader import keep_bf16_tensors

# A gate/up's batches past the AMX tiles go in pieces of at most this many rows, each piece's SiLU-and-mul taken
# while its product is still in cache. A 2048-token prefill step's whole product (0.5B Qwen2: 40 MB in bf16, 80
# in float32) went to memory and back: on 2 cores of an Emerald Rapids Xeon a gated bf16 layer took 12.1-14.4 ms
# whole against 10.9-11.8 in pieces of 512 rows, about oneDNN's product alone (10.2-10.9); pieces of 1024 ran as
# 512, of 256 12.5, of 128 15. In float32 the whole product and its result also set the heap's high-water mark:
# a first W1 prefill step (8 x 256 tokens) grew resident memory by 0.41 GB whole, 0.25 GB in pieces.
SILU_PIECE_ROWS = 512


class DenseLinearMethod(LinearMethod):
    """Per layer: `packed` (the weight in oneDNN's layout, or None), `small_batch_weight` (what the small-batch
    kernel reads: a view of `packed`, or bf16 blocks of a float32 weight's bf16 values and no `packed`; None where
    it cannot serve) and `silu_table` (a gated gate/up's: fused_ops.bf16_silu_table, which the epilogue looks its
    gates up in; else None). A float32 weight is packed only where the kernel reads oneDNN's layout, and stays
    plain on MKL elsewhere."""

    plain_weights = True

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size)
        if layer.params_dtype == torch.float32 and bf16_valued.available():
            keep_bf16_tensors(layer.weight)  # a tied one's too: the embedding's table
        layer.bias = layer.row_parameter() if layer.with_bias else None
        layer.packed = None
        layer.small_batch_weight = None
        layer.silu_table = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Switch to the packed weight (a float32 one of bf16 values: to its blocks in bf16) and free the plain
        one unless the embedding needs it (float32: where the small-batch kernel reads the packed one)."""
        narrow = bf16_valued.narrowed(layer.weight.detach()) if layer.params_dtype == torch.float32 else None
        if narrow is not None:  # float32 of bf16 values: its bf16 blocks serve every batch
            layer.packed, layer.small_batch_weight = None, narrow
            if not layer.tied:
                layer.weight = None
            return
        if layer.weight.dtype != layer.params_dtype:  # kept in bf16 by its loader, and not narrowed after all
            layer.weight.data = layer.weight.data.to(layer.params_dtype)
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
        """SiLU-and-mul of the product: from the AMX tiles' epilogue where they take the batch; else the op over
        the product, a large batch's piece by piece (SILU_PIECE_ROWS), each piece's while it is in cache."""
        if layer.silu_table is not None:
            out = small_batch_gemm.linear_silu_and_mul(x, layer.small_batch_weight, layer.silu_table)
            if out is not None:
                return out
        if x.dim() != 2 or x.shape[0] <= SILU_PIECE_ROWS:
            return self.silu_and_mul_of_product(layer, x)
        out = x.new_empty(x.shape[0], layer.output_size // 2)
        pieces = -(-x.shape[0] // SILU_PIECE_ROWS)
        rows = -(-x.shape[0] // pieces)  # pieces of equal size (the last may be smaller)
        for r in range(0, x.shape[0], rows):
            self.silu_and_mul_of_product(layer, x[r:r + rows], out[r:r + rows])
        return out

    def silu_and_mul_of_product(self, layer: Linear, x: torch.Tensor,
                                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The op over the layer's product (into `out` if given), in the gated layout's order where it has it."""
        if layer.silu_table is not None:
            return gated_layout.silu_and_mul_gated(self.product(layer, x), out=out)
        result = silu_and_mul(self.product(layer, x))
        return result if out is None else out.copy_(result)

    def product(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) on the kernel for the batch's size; a gated weight's columns in its layout."""
        if layer.small_batch_weight is not None and small_batch_gemm.serves(x):
            return small_batch_gemm.linear(x, layer.small_batch_weight, layer.bias)
        if layer.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        if layer.small_batch_weight is not None:  # kept only as the kernel's blocks: bf16 values of float32
            return bf16_valued.linear(x, layer.small_batch_weight, layer.bias)
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
