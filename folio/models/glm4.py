"""GLM (glm-4-9b-chat-hf: GlmForCausalLM) and GLM-4 (GLM-4-0414, GLM-Z1: Glm4ForCausalLM): the Llama decoder with

  * q/k/v biases (attention_bias, true unless the config says otherwise, as in Transformers' configs);
  * RoPE on the first partial_rotary_factor of each head (0.5 unless the config says otherwise), its channels
    turning in interleaved pairs (2i, 2i+1), GPT-J style (folio.models.layers.InterleavedRotaryEmbedding);
  * gate and up fused in the checkpoint (mlp.gate_up_proj, gate first), loaded as the fused layer's shards;
  * GLM-4 only: "sandwich" norms, an RMSNorm on the attention's output and one on the MLP's, each before its
    residual add (post_self_attn_layernorm, post_mlp_layernorm).

The GLM-4 MoE models (Glm4MoeForCausalLM) are another architecture.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from folio.models.layers import InterleavedRotaryEmbedding, RMSNorm, RotaryEmbedding
from folio.models.llama import LlamaDecoderLayer, LlamaForCausalLM, StepContext
from folio.models.model_config import ModelConfig
from folio.models.weight_loader import ALL_SHARDS


def with_glm_defaults(cfg: ModelConfig) -> ModelConfig:
    """cfg with Transformers' GlmConfig / Glm4Config defaults for what config.json leaves out: q/k/v biases and half
    of each head rotating (ModelConfig's own defaults are Llama's: no biases, whole heads)."""
    hf = cfg.hf_config
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    changes: dict[str, object] = {}
    if "attention_bias" not in hf:
        changes["attention_bias"] = True
    if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in rope:
        changes["partial_rotary_factor"] = 0.5
    return dataclasses.replace(cfg, **changes) if changes else cfg


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the attention's and the MLP's outputs normalised again before their residual adds."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], ctx: StepContext):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, ctx))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class GlmForCausalLM(LlamaForCausalLM):
    rotary_cls = InterleavedRotaryEmbedding
    # gate_up_proj is fused in every GLM checkpoint; q/k/v are separate in Transformers' and fused (qkv_proj) in
    # llama.cpp's ChatGLM files
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "qkv_proj": ("qkv_proj", ALL_SHARDS), "gate_up_proj": ("gate_up_proj", ALL_SHARDS)}

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(with_glm_defaults(cfg), max_positions)


class Glm4ForCausalLM(GlmForCausalLM):
    layer_cls = Glm4DecoderLayer
