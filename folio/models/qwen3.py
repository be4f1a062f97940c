"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE, and no q/k/v biases."""

from __future__ import annotations

import torch

from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from folio.models.model_config import ModelConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
