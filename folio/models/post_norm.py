"""Post-norm decoder blocks (OLMo 2 and 3, EXAONE 4): no norm before attention or the MLP; each one's output is
RMS-normalised before its residual add, x + norm(attention(x)), then x + norm(mlp(x)). Llama's layers fuse their
pre-norms with the residual adds; these keep the residual stream as it is, and the model's final norm closes it."""

from __future__ import annotations

import torch
from torch import nn

from folio.models.hot_path import HotPathModule
from folio.models.layers import RMSNorm
from folio.models.llama import LlamaForCausalLM, LlamaMLP, StepContext
from folio.models.model_config import ModelConfig


class PostNormDecoderLayer(HotPathModule):
    """A family's attention (given) and Llama's MLP, each output normalised by `norm_cls` before its residual add."""

    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class PostNormForCausalLM(LlamaForCausalLM):
    """The Llama model whose layers (`layer_cls`, PostNormDecoderLayers) take and give the residual stream itself."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)
