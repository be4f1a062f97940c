"""The fused mixture-of-experts method: unquantised (float32, bf16) experts in one C++ call per layer
(folio/csrc/cpu_fused_moe.cpp).

After loading, an MoE layer's expert weights are stacked into w13 [E, 2I, H] (gate rows, then up rows, as
each expert's fused gate_up_proj) and w2 [E, H, I], their biases where they have some (GPT-OSS) into float32 b13
[E, 2I] and b2 [E, H], and the per-expert modules are dropped (their weights freed). A step then makes one call:
the (token, slot) choices grouped by expert, each expert's gate/up GEMM, SiLU(gate) * up (or GPT-OSS's clamped
SwiGLU, experts_method.ClampedSwiGLU) and down GEMM on its rows, and each token's weighted sum, all threads working
on (expert, column block) tasks so that every weight row is read once per step by one thread. Experts with
`gemm_min_rows` rows or more (prefill) use ATen's GEMMs inside the same call.

A float32 model keeps a bf16 checkpoint's experts in bf16 (`held_dtype`), as its dense layers keep their
weights (folio.models.bf16_valued): the experts are most of an MoE model's bytes, and the kernel computes in
float32 on the exactly widened values, so the results are those of float32 experts (bit for bit on the
kernel's own tiles; on ATen's GEMMs, which get a widened copy, to the GEMM's rounding).

Why: the per-expert path (folio.models.experts_method.PerExpertMethod) issues about ten torch ops per
chosen expert per layer, each small matmul threaded on its own; at decode batch sizes every expert runs in
every layer, so those fixed costs dominate the step. Measured on a 2-core AVX2 EPYC (shared, noisy; the
README's "Mixture of experts: measured" has the commands): a 16-expert top-2 Qwen3-MoE decoded a batch of 64
1.77-2.17x (float32) and 1.65-2.02x (bf16) faster fused than per expert; at batch 1, where both read the same
weights, level in float32 and 11-13% faster fused in bf16.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from folio.csrc_build import CSRC, CppKernel
from folio.models import bf16_valued
from folio.models.experts_method import ExpertsMethod
from folio.models.linear import Linear
from folio.platforms.cpu_features import has_fast_bf16

if TYPE_CHECKING:
    from folio.models.moe import Experts

KERNEL = CppKernel("folio_cpu_fused_moe", CSRC / "cpu_fused_moe.cpp", what="CPU fused MoE kernel",
                   fallback="experts run one by one")
# From this many rows an expert runs on ATen's GEMMs (MKL / oneDNN), below it on the kernel's own tiles.
# Measured in float32 on a 2-core AVX2 EPYC (16 experts of 768 x 768, top-2): the kernel is faster at 64 rows
# per expert (204 vs 254 ms per layer call), MKL at 128 (389 vs 441).
GEMM_MIN_ROWS = 96
DTYPES = (torch.float32, torch.bfloat16)


def gemm_min_rows(dtype: torch.dtype) -> int:
    """Where ATen's GEMMs take over. Without AMX or AVX512-BF16, ATen's bf16 GEMM is emulated and 4x slower
    than the kernel even at 128 rows per expert (same measurement): the kernel then takes every size."""
    if dtype == torch.bfloat16 and not has_fast_bf16():
        return sys.maxsize
    return GEMM_MIN_ROWS


def supports(layers: list[Linear]) -> bool:
    """Whether experts made of these Linear layers can run fused: all keep plain CPU float32 or bf16 weights
    of one dtype (their linear method's plain_weights), and the kernel builds."""
    dtypes = {layer.params_dtype for layer in layers}
    return (len(dtypes) == 1 and dtypes <= set(DTYPES)
            and all(layer.method.plain_weights and not layer.tied and layer.weight.is_cpu for layer in layers)
            and KERNEL.load() is not None)


def stacked(layers: list[Linear], dtype: torch.dtype) -> torch.Tensor:
    """The plain-weight layers' matrices as one [E, N, K] tensor in dtype, each copied in, so that no list of copies
    is held beside it."""
    out = torch.empty(len(layers), *layers[0].weight.shape, dtype=dtype)
    for e, layer in enumerate(layers):
        out[e].copy_(layer.weight.detach())
    return out


def stacked_biases(layers: list[Linear]) -> Optional[torch.Tensor]:
    """The layers' biases as one float32 [E, N] tensor (the kernel adds them to its float32 products), or None where
    they have none."""
    if layers[0].bias is None:
        return None
    return torch.stack([layer.bias.detach().float() for layer in layers])


def held_dtype(layers: list[Linear]) -> torch.dtype:
    """The layers' params_dtype, except bf16 for float32 experts whose every value is a bf16 one (a bf16
    checkpoint's, loaded as bf16: LinearMethod.plain_weights): half the bytes, which the kernel widens exactly as
    it reads them. One dtype for all of a layer's experts, gate/up and down alike (the kernel takes one)."""
    dtype = layers[0].params_dtype
    if dtype == torch.float32 and all(bf16_valued.holds_bf16_values(layer.weight.detach()) for layer in layers):
        return torch.bfloat16
    return dtype


class FusedExpertsMethod(ExpertsMethod):
    def __init__(self, dtype: torch.dtype) -> None:
        self.gemm_min_rows = gemm_min_rows(dtype)
        self.swiglu = (0.0, 0.0)  # the kernel's (swiglu_alpha, swiglu_limit) from the experts' activation; 0: SiLU

    def process_weights_after_loading(self, experts: "Experts") -> None:
        """Stack the experts' weights into experts.w13 and experts.w2, their biases into experts.b13 and experts.b2
        (None without); the expert modules go."""
        gate_up, down = [mlp.gate_up_proj for mlp in experts], [mlp.down_proj for mlp in experts]
        dtype = held_dtype(gate_up + down)
        experts.w13 = nn.Parameter(stacked(gate_up, dtype), requires_grad=False)
        experts.w2 = nn.Parameter(stacked(down, dtype), requires_grad=False)
        experts.b13, experts.b2 = stacked_biases(gate_up), stacked_biases(down)
        activation = experts.activation
        self.swiglu = (0.0, 0.0) if activation is None else (activation.alpha, activation.limit)
        del experts[:]

    def apply(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return KERNEL.load().fused_moe(x, experts.w13, experts.w2, weights, ids, self.gemm_min_rows, experts.b13,
                                       experts.b2, *self.swiglu)
