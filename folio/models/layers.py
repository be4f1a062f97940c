"""Building blocks shared by the decoder models: embedding, RMSNorm, rotary embedding, gated MLP activation
(linear layers: folio.models.linear).

Each produces the same numbers as Hugging Face Transformers' own layers, because greedy outputs must match
Transformers token for token. The elementwise ops run fused C++ kernels in bf16 (folio.models.fused_ops),
bit-identical to the torch reference code they fall back to.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from folio.models import fused_ops
from folio.models.weight_loader import uninitialized


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = uninitialized(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalise x, or (x + residual) when a residual is given, returning (normed, new residual)."""
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed float32 cos/sin table indexed by position.

    The tables are buffers, so moving the model to a device moves them; they stay float32 whatever the
    model's dtype (a dtype cast of the model leaves them alone: see _apply), and are cast per use exactly as
    Transformers casts its cos/sin. Not persistent: they are computed, never loaded from a checkpoint.
    One instance is shared by every layer of a model.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]]) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Apply a .to()/.cuda()/.half()-style conversion to the tables' device only: fn says where the
        tables go, and the float32 originals are moved there (converting them and back would round)."""
        tables = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, table in tables.items():
            self._buffers[name] = table.to(self._buffers[name].device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], rotated in place (they are views of the step's qkv output)."""
        return fused_ops.rotary_embedding_(positions, q, k, self.cos, self.sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul(gate_up)
