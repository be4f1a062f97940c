"""How a mixture-of-experts layer's routed experts compute (vLLM's fused-MoE method pattern, on folio's seams).

Each expert is declared as a LlamaMLP of Linear layers, so every linear method loads and serves expert weights
(dense, int8, int4, GGUF blocks). After loading, `folio.models.moe.experts_method` picks the layer's
ExpertsMethod, in that one place: experts whose linear method keeps plain float weights run fused
(folio.models.fused_moe: the weights stacked, one C++ call per layer); any other keeps `PerExpertMethod`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from folio.models.moe import Experts


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated activation of its experts, instead of SiLU(gate) * up: the gate clamped above at `limit`, up
    to [-limit, limit], then gate * sigmoid(gate * alpha) * (up + 1), in Transformers' order of operations
    (GptOssExperts._apply_gate). Both methods compute it: the per-expert one here, the fused one in its kernel."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.limit}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class ExpertsMethod(ABC):
    def process_weights_after_loading(self, experts: "Experts") -> None:
        """Take the loaded expert weights into the form `apply` wants; runs before the experts' own linear
        methods process them (a method that takes the weights over removes the expert modules). Default:
        nothing."""

    @abstractmethod
    def apply(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, H], rows per expert [E] int64) for x [T, H] routed to experts ids [T, top_k] with
        weights [T, top_k]: out[t] = sum over k of weights[t, k] * expert ids[t, k] (x[t])."""


class PerExpertMethod(ExpertsMethod):
    """Each chosen expert's module (a LlamaMLP, or moe.ClampedSwiGLUExpert) runs once on all of its tokens
    (index_select in, weighted index_add out), through its Linear layers' methods: works for any linear method
    (quantised experts)."""

    def apply(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top_k = ids.shape[1]
        order = torch.argsort(ids.flatten(), stable=True)  # (token, slot) choices grouped by expert
        counts = torch.bincount(ids.flatten(), minlength=experts.num_experts)
        tokens, slot_weights = order // top_k, weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                rows = tokens[start:start + count]
                y = experts[expert](x.index_select(0, rows)) * slot_weights[start:start + count]
                out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out, counts
