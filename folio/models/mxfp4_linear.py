"""Linear layers that keep MXFP4 weights (GPT-OSS's experts) as stored: a quarter of bf16's bytes.

The weight is what the checkpoint holds (folio.models.mxfp4's format): `weight` uint8 [N, K / 32, 16], 32 E2M1 codes a
block, low nibble first, and `weight_scale` uint8 [N, K / 32], an E8M0 exponent per block; a fused layer (gate/up)
loads each shard's rows of both. gpt-oss-20b keeps about 13 GB so instead of 42 GB dequantised to bf16, and a decode
step reads 17 bytes per 32 weights where bf16 reads 64. A GGUF file's MXFP4 tensors reach the same loaders, repacked
from ggml's block order (folio.loader.gguf_native.mxfp4_from_ggml), where they run as stored.

`apply` computes x @ dequantize(W)^T + b in float32 exactly as on the dequantised weight (every MXFP4 value is a
float32 one), only summed in another order: batches of fewer than GEMM_MIN_ROWS rows in the C++ kernel
(folio/csrc/cpu_mxfp4_linear.cpp: the codes decoded in registers, weights read once per call), larger ones by
ATen's float32 GEMM on the weight dequantised for the call (in C++). Without the kernel, the torch reference does the
same on mxfp4.dequantize's weight; the loader then chooses it for no layer and dequantises at load instead
(`mxfp4_chooser`), which keeps the fused experts' speed at bf16's memory.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from folio.csrc_build import CSRC, CppKernel
from folio.models import mxfp4
from folio.models.linear import Linear, LinearMethod, LinearMethodChooser
from folio.models.weight_loader import ShardId, set_weight_loader

KERNEL = CppKernel("folio_cpu_mxfp4_linear", CSRC / "cpu_mxfp4_linear.cpp", what="CPU MXFP4 linear kernel",
                   fallback="MXFP4 checkpoints are dequantised at load")
# From this many rows of x, ATen's float32 GEMM on the weight dequantised for the call. On Zen 3 (AVX2, 2 threads,
# shared with other work: noisy) the kernel took 40 ms at 64 rows of a 2880 x 5760 layer where dequantising and the
# GEMM took 107, 20 against 18 for a 2880 x 2880 one; at 256 rows 191 against 184, and 91 against 71.
GEMM_MIN_ROWS = 128
# An expert's Linear layer: what an MXFP4 checkpoint quantises (GPT-OSS keeps attention, router and head in bf16).
_EXPERT_LAYER = re.compile(r"\.experts\.\d+\.")


def available() -> bool:
    return KERNEL.load() is not None


def isas() -> list[int]:
    """The instruction sets compiled into the kernel here (0 scalar, 1 AVX2+FMA, 2 AVX-512), best last; [] without
    the kernel."""
    ext = KERNEL.load()
    return list(ext.isas()) if ext is not None else []


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] (the kernel's, or mxfp4.dequantize's exact bf16 widened)."""
    ext = KERNEL.load()
    return ext.dequantize(blocks, scales) if ext is not None else mxfp4.dequantize(blocks, scales).float()


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor],
           isa: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (float32 or bf16) @ W^T (+ float32 bias [N]) in x's dtype, summed in float32: the kernel (with the
    instruction set asked for), or F.linear on the dequantised weight."""
    ext = KERNEL.load()
    if ext is None:
        return F.linear(x.float(), dequantize(blocks, scales), bias).to(x.dtype)
    return ext.linear(x, blocks, scales, bias) if isa is None else ext.linear(x, blocks, scales, bias, isa)


class Mxfp4LinearMethod(LinearMethod):
    """layer.weight: the blocks uint8 [N, K / 32, 16]; layer.weight_scale: uint8 [N, K / 32]; layer.bias: float32
    after loading. Both take uint8 checkpoint tensors only (a float tensor would be cast to codes silently)."""

    def create_weights(self, layer: Linear) -> None:
        if layer.tied or layer.input_size % mxfp4.BLOCK:
            raise ValueError(f"an MXFP4 layer needs its own weight and an input size divisible by {mxfp4.BLOCK}, got "
                             f"Linear({layer.input_size}, {layer.output_size}{', tied' if layer.tied else ''})")
        groups = layer.input_size // mxfp4.BLOCK
        layer.weight = self._uint8_rows(layer, groups, mxfp4.BLOCK // 2)
        layer.weight_scale = self._uint8_rows(layer, groups)
        layer.bias = layer.row_parameter() if layer.with_bias else None

    @staticmethod
    def _uint8_rows(layer: Linear, *row_shape: int) -> nn.Parameter:
        param = nn.Parameter(torch.empty(layer.output_size, *row_shape, dtype=torch.uint8), requires_grad=False)

        def load(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
            if tensor.dtype != torch.uint8:
                raise ValueError(f"has dtype {tensor.dtype}, expected torch.uint8 (MXFP4 blocks or scales)")
            layer.load_rows(p, tensor, shard_id)

        set_weight_loader(param, load, layer.shards)
        return param

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.bias is not None:  # the kernel adds it in float32
            layer.bias = nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.input_size)
        if rows.shape[0] >= GEMM_MIN_ROWS:
            y = F.linear(rows.float(), dequantize(layer.weight, layer.weight_scale), layer.bias).to(x.dtype)
        else:
            y = linear(rows, layer.weight, layer.weight_scale, layer.bias)
        return y.reshape(*x.shape[:-1], layer.output_size)


def mxfp4_chooser(otherwise: LinearMethodChooser) -> LinearMethodChooser:
    """The methods of an MXFP4 checkpoint (quant_method "mxfp4"): its experts' Linear layers keep the blocks where
    the kernel builds (else they load dequantised, folio.models.gpt_oss); every other layer, stored in float,
    `otherwise`."""
    method = Mxfp4LinearMethod()

    def choose(name: str, layer: Linear) -> LinearMethod:
        return method if _EXPERT_LAYER.search(f".{name}") and available() else otherwise(name, layer)

    return choose
