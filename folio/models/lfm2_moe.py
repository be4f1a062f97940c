"""LFM2-MoE (Liquid AI's LFM2-8B-A1B: Lfm2MoeForCausalLM): LFM2's decoder (folio.models.lfm2: gated short
convolutions and Qwen3-style attention, as its layer_types say) whose feed-forward, after the first
num_dense_layers dense MLPs, is a mixture of experts without shared ones.

Its router (Transformers' Lfm2MoeTopKRouter) is DeepSeek V3's in one group (folio.models.grouped_topk): sigmoid
scores, to which the block's expert_bias (float32) is added to choose the top-k experts where use_expert_bias says
so, the weights being the unbiased scores of the chosen ones; renormalised where norm_topk_prob says so, by their sum
plus 1e-6 (Lfm2MoeTopKRouter's, where the grouped router adds 1e-20), then multiplied by routed_scaling_factor
(model_config.lfm2_fields). It runs in float32, where Transformers runs in the checkpoint's dtype.

Checkpoint names: feed_forward.gate (the router), feed_forward.expert_bias, feed_forward.experts.E.w1 / w3 / w2
(gate, up, down, as LFM2's MLP names them).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.models.deepseek_v2 import DeepseekMoE
from folio.models.grouped_topk import GroupedTopKRouter
from folio.models.lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM
from folio.models.llama import LlamaMLP
from folio.models.model_config import ModelConfig
from folio.models.weight_loader import ShardId


class Lfm2MoeRouter(GroupedTopKRouter):
    """The grouped router's choice and weights, renormalised and scaled here, Lfm2MoeTopKRouter's way."""

    def __init__(self, cfg: ModelConfig) -> None:
        hf = cfg.hf_config
        super().__init__(cfg.hidden_size, {**hf, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
                         cfg.moe.num_experts, cfg.moe.top_k)
        self.renormalize, self.factor = bool(hf["norm_topk_prob"]), float(hf["routed_scaling_factor"])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = super().forward(x)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.factor, experts


class Lfm2MoeBlock(DeepseekMoE):
    """DeepSeek's block (routed experts, their ranks' partial sums added once; no shared experts here) around LFM2-MoE's
    router."""

    def make_router(self, cfg: ModelConfig) -> nn.Module:
        return Lfm2MoeRouter(cfg)


class Lfm2MoeDecoderLayer(Lfm2DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: num_experts is 0 (a mixture of experts needs experts)")
        return Lfm2MoeBlock(cfg) if cfg.moe.is_sparse(layer_idx) else LlamaMLP(cfg)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    layer_cls = Lfm2MoeDecoderLayer

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        """The block's expert_bias is its router's correction bias here."""
        return super().map_checkpoint_name(name.replace(".feed_forward.expert_bias",
                                                        ".feed_forward.gate.e_score_correction_bias"))
