"""IBM Granite 3.x (dense): the Llama decoder with four scalars from its config, as Transformers applies them.

  * embedding_multiplier: the token embeddings are multiplied by it before the first layer;
  * residual_multiplier: each attention and MLP output is multiplied by it before its residual add;
  * attention_multiplier: the softmax scale, in place of head_dim ** -0.5;
  * logits_scaling: the logits are divided by it.

Each is the same tensor-times-Python-float (or divided-by) op as Transformers', so the results round alike in
every dtype. Granite's MoE variants (GraniteMoe*) and Granite 4's hybrid Mamba layers are other architectures.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from folio.attention.backend import AttentionParams
from folio.models.layers import RotaryEmbedding
from folio.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, StepContext
from folio.models.model_config import ModelConfig
from folio.sample.sampling_ops import argmax_rows


def multiplier(cfg: ModelConfig, name: str) -> float:
    """A Granite scalar of the config, 1.0 where it is left out (Transformers' GraniteConfig default)."""
    value = cfg.hf_config.get(name)
    return 1.0 if value is None else float(value)


class GraniteAttention(LlamaAttention):
    """Llama's attention scaled by attention_multiplier, its output by residual_multiplier."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.attn_params = AttentionParams(scale=multiplier(cfg, "attention_multiplier"),
                                           sliding_window=cfg.sliding_window(layer_idx))
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return super().forward(positions, x, ctx) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    """Llama's MLP, its output multiplied by residual_multiplier."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return GraniteMLP(cfg)


class GraniteForCausalLM(LlamaForCausalLM):
    layer_cls = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.embedding_multiplier = multiplier(cfg, "embedding_multiplier")
        self.logits_scaling = multiplier(cfg, "logits_scaling")
        if not self.logits_scaling > 0:
            raise ValueError(f"{cfg.architecture}: logits_scaling must be positive, got {self.logits_scaling}")
        # dividing by a power of two is exact, so it keeps the head's order, ties included (the released Granite 3
        # models divide by 8 or 16); another divisor may round two logits the head ranked apart to a tie
        self.exact_scaling = math.frexp(self.logits_scaling)[0] == 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax(compute_logits(hidden), dim=-1), int64: the head's own argmax where the division keeps its order
        exactly, else the divided logits' (Transformers' greedy picks the first of tied logits)."""
        if self.exact_scaling:
            return self.lm_head.argmax(hidden)
        return argmax_rows(self.compute_logits(hidden))
