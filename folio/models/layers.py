"""Building blocks shared by the decoder models: embedding, RMSNorm, rotary embedding, gated MLP activation
(linear layers: folio.models.linear).

Each produces the same numbers as Hugging Face Transformers' own layers, because greedy outputs must match
Transformers token for token. The elementwise ops run fused C++ kernels in bf16 (folio.models.fused_ops),
bit-identical to the torch reference code they fall back to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from folio.models import fused_ops
from folio.models.hot_path import HotPathModule
from folio.models.rope_scaling import cos_sin_tables
from folio.models.weight_loader import keep_bf16_tensors, uninitialized

if TYPE_CHECKING:
    from folio.models.model_config import ModelConfig


class Embedding(HotPathModule):
    """Token ids to vectors: rows of `weight`, or, once a tied lm_head's processed copy serves them
    (folio.models.linear.share_tied_tables), of that copy, the table freed.

    A float32 table that a checkpoint stores in bf16 is kept in bf16 (weight_loader.keep_bf16_tensors) and its rows
    widened, exactly, as they are looked up: a float32 copy would hold the same values in twice the bytes
    (Qwen2-7B's table: 2.2 GB against 1.1). A table a tied lm_head shares (Linear marks it `tied_head`) is left to
    the head's linear method (the dense and quantised ones keep it in bf16 too)."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = uninitialized(num_embeddings, dim)
        self.dtype = self.weight.dtype  # what lookups return, whatever the table is held in
        if self.dtype == torch.float32:
            keep_bf16_tensors(self.weight, unless=lambda p: getattr(p, "tied_head", False))
        self.rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def _apply(self, fn, recurse=True):
        """A dtype cast of the module (`.to(torch.bfloat16)`) changes what lookups return too."""
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return super()._apply(fn, recurse)

    def look_up_in(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take rows from `rows` (ids -> [*ids.shape, dim]) from now on, and free the table."""
        self.rows = rows
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(ids)
        return nn.functional.embedding(ids, self.weight).to(self.dtype)


class RMSNorm(HotPathModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalise x, or (x + residual) when a residual is given, returning (normed, new residual)."""
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(HotPathModule):
    """Neox-style rotary embedding with a precomputed float32 cos/sin table indexed by position.

    The tables are buffers, so moving the model to a device moves them; they stay float32 whatever the
    model's dtype (a dtype cast of the model leaves them alone: see _apply), and are cast per use exactly as
    Transformers casts its cos/sin. Not persistent: they are computed, never loaded from a checkpoint.
    One instance is shared by every layer of a model.

    scaling: the checkpoint's rope_scaling (folio.models.rope_scaling); max_len: its max_position_embeddings,
    which some scaling types read. rotary_dim: how many leading channels of each head rotate (partial rotary,
    Phi-4-mini), all by default.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]],
                 rotary_dim: Optional[int] = None, max_len: Optional[int] = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.partial = self.rotary_dim != head_dim
        cos, sin = cos_sin_tables(self.rotary_dim, max_positions, theta, scaling, max_len or max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_positions: int, theta: float,
                  scaling: Optional[dict[str, Any]]) -> RotaryEmbedding:
        """A rotary embedding of the model's head (its rotary_dim) and original context (max_len): every model
        builds its tables so, since the scaling types that read the context length (yarn without a factor,
        dynamic) would otherwise take max_positions for it. theta and scaling: the layers' own (Gemma 3's local
        layers have a base of their own), usually the config's rope_theta and rope_scaling."""
        return cls(cfg.head_dim, max_positions, theta, scaling, cfg.rotary_dim, cfg.max_position_embeddings)

    def _apply(self, fn, recurse=True):
        """Apply a .to()/.cuda()/.half()-style conversion to the tables' device only: fn says where the
        tables go, and the float32 originals are moved there (converting them and back would round)."""
        tables = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, table in tables.items():
            self.register_buffer(name, table.to(self._buffers[name].device), persistent=False)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], rotated in place (they are views of the step's qkv output)."""
        if self.partial:
            rot = self.rotary_dim
            fused_ops.rotary_embedding_(positions, q[..., :rot], k[..., :rot], self.cos, self.sin)
            return q, k
        return fused_ops.rotary_embedding_(positions, q, k, self.cos, self.sin)


class NoRotary(HotPathModule):
    """What a NoPE layer's attention calls in place of RoPE: q and k pass as they are (SmolLM3's, EXAONE 4's and
    Cohere 2's NoPE layers; every layer of a model whose rotary_cls it is: Granite 4.0-H)."""

    @classmethod
    def for_model(cls, *args: Any) -> "NoRotary":
        return cls()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """GPT-J-style rotary embedding (GLM, GLM-4): channels 2i and 2i+1 of the rotated part of each head turn together
    by frequency i, where the neox style turns channels i and i + rotary_dim/2.

    Each pair is gathered into the two halves the neox kernel rotates, rotated there, and scattered back: the
    kernel's products and sums are Transformers' own (x * cos + rotate_half(x) * sin, pair by pair), so the numbers
    are the same to the bit, for two copies of the rotated channels."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], rotated in place (they are views of the step's qkv output)."""
        # [T, H, rot] as [T, H, 2, rot/2]: row 0 the even channels, row 1 the odd ones
        pairs = [x[..., :self.rotary_dim].unflatten(-1, (-1, 2)).transpose(-1, -2) for x in (q, k)]
        halves = [p.flatten(-2) for p in pairs]  # copies, in neox order
        fused_ops.rotary_embedding_(positions, *halves, self.cos, self.sin)
        for p, h in zip(pairs, halves):
            p.copy_(h.unflatten(-1, (2, -1)))
        return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul(gate_up)
