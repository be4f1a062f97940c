"""The dense CPU linear method: unquantised weights, each batch on the fastest CPU kernel for its size.

In bf16 the weight is reordered once, after loading, into oneDNN's blocked layout, and the plain one is freed
(unless it is the embedding's): plain F.linear reorders it on every call, which costs 10-40% of a decode step's
matmuls. Batches of at most small_batch_gemm.MAX_ROWS rows go to a kernel that reads that same packed weight
in place, faster than oneDNN's GEMM at those sizes; one copy of the weight serves every batch size. float32
layers keep their plain weight on F.linear (MKL), and send batches of at most eight rows to the kernel, which
reads the weight once where MKL packs it on every call.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.models import small_batch_gemm
from folio.models.linear import Linear, LinearMethod

# oneDNN's blocked weight layout is chosen for a batch size; decode batches of tens of requests dominate.
PACK_FOR_BATCH = 64


def can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN's bf16 linear, on a CPU that has it (the reorder refuses CPUs without AVX-512 or AVX-NE-CONVERT)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseLinearMethod(LinearMethod):
    """Per layer: `packed` (the bf16 weight in oneDNN's layout, or None) and `small_batch_weight` (what the
    small-batch kernel reads: a view of `packed`, or the plain float32 weight; None where it cannot serve)."""

    plain_weights = True

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size)
        layer.bias = layer.row_parameter() if layer.with_bias else None
        layer.packed = None
        layer.small_batch_weight = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """bf16: switch to the packed weight and free the plain one unless the embedding needs it. float32: small
        batches go to the kernel, which reads the plain weight."""
        if layer.weight.dtype == torch.float32:
            layer.small_batch_weight = layer.weight if small_batch_gemm.supports(layer.weight) else None
            return
        if not (can_prepack(layer.weight.dtype) and layer.weight.is_cpu):
            return
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_FOR_BATCH)
        layer.small_batch_weight = small_batch_gemm.packed_blocks(layer.packed, layer.weight.detach())
        if not layer.tied:
            layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
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
