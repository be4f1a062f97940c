"""The dense CPU linear method: unquantised weights, each batch on the fastest CPU kernel for its size.

In bf16 the weight is reordered once, after loading, into oneDNN's blocked layout; plain F.linear reorders
it on every call, which costs 10-40% of a decode step's matmuls. The results are bit-identical. Batches of
at most small_batch_gemm.MAX_ROWS rows may instead go to a kernel that streams the plain weight faster
(`small_batches`), which in bf16 needs the plain weight kept besides the packed one: see small_batch_gemm for
when that is worth it. float32 layers keep their plain weight on F.linear (MKL), and send batches of at most
eight rows to the kernel, which reads the weight once where MKL packs it on every call.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.models import small_batch_gemm
from folio.models.linear import Linear, LinearMethod, linear_layers

# oneDNN's blocked weight layout is chosen for a batch size; decode batches of tens of requests dominate.
_PACK_FOR_BATCH = 64


def _can_prepack(dtype: torch.dtype) -> bool:
    """oneDNN's bf16 linear, on a CPU that has it (the reorder refuses CPUs without AVX-512 or AVX-NE-CONVERT)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseLinearMethod(LinearMethod):
    """keep_copies: whether layers keep their plain weight for the small-batch kernel. That is a model-wide
    choice (the copies' total size against memory), so the method is made for a model: `for_model`.
    The tied lm_head keeps its plain weight anyway (it is the embedding) and uses the kernel when it can."""

    plain_weights = True

    def __init__(self, keep_copies: bool) -> None:
        self.keep_copies = keep_copies

    @classmethod
    def for_model(cls, model: nn.Module) -> "DenseLinearMethod":
        """Decided from the layers' declared sizes, before any weight exists."""
        packable = [layer for _, layer in linear_layers(model) if _can_prepack(layer.params_dtype)]
        copies = sum(layer.output_size * layer.input_size * layer.params_dtype.itemsize
                     for layer in packable if not layer.tied)
        return cls(keep_copies=bool(packable) and small_batch_gemm.worth_copies(copies))

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size)
        layer.bias = layer.row_parameter() if layer.with_bias else None
        layer.packed = None  # the weight in oneDNN's layout, once loaded (bf16 only)
        layer.small_batches = False

    def process_weights_after_loading(self, layer: Linear) -> None:
        """bf16: switch to the packed weight; the plain one is freed unless the small-batch kernel or the
        embedding needs it. float32: small batches go to the kernel, which reads the plain weight."""
        if layer.weight.dtype == torch.float32:
            layer.small_batches = small_batch_gemm.supports(layer.weight)
            return
        if not (_can_prepack(layer.weight.dtype) and layer.weight.is_cpu):
            return
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), _PACK_FOR_BATCH)
        wants_kernel = self.keep_copies or (layer.tied and small_batch_gemm.available())
        layer.small_batches = wants_kernel and small_batch_gemm.supports(layer.weight)
        if not (layer.tied or layer.small_batches):
            layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.small_batches and small_batch_gemm.serves(x):
            return small_batch_gemm.linear(x, layer.weight, layer.bias)
        if layer.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        return nn.functional.linear(x, layer.weight, layer.bias)
