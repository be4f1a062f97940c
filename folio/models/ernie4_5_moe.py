"""Baidu ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B; Ernie4_5_MoeForCausalLM), text only: dense ERNIE 4.5's
decoder (folio.models.ernie4_5: RoPE on interleaved pairs) with routed experts (folio.models.moe) in the layers the
config makes sparse (folio.models.model_config.ernie_moe_fields), dense MLPs in the others.

What differs from the other mixtures of experts, as Transformers computes it:

  * the router works in float32 whatever the model's dtype (Transformers keeps gate.weight and the correction bias
    in float32): softmax over the logits; each token's top-k experts are those of the largest probability plus
    e_score_correction_bias (a load-balancing bias that only chooses); their weights are the unbiased
    probabilities, renormalised to sum 1 with the sum floored at moe_norm_min, then in the activations' dtype;
  * moe_num_shared_experts shared experts (one MLP of their total size, `shared_experts`) take every token, ungated,
    and add to the routed experts' sum;
  * the checkpoint keeps the bias beside the router, as mlp.moe_statics.e_score_correction_bias [1, experts];
    Transformers loads it into mlp.gate, as folio does; the multi-token-prediction layers (model.mtp_*) are not
    served, as Transformers skips them.

Tensor parallelism as for the other mixtures: every rank routes all tokens with the whole router and keeps its
columns of every expert and of the shared experts; the block sums the ranks' partial outputs once.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.ernie4_5 import Ernie4_5ForCausalLM
from folio.models.hot_path import HotPathModule
from folio.models.layers import RotaryEmbedding
from folio.models.llama import LlamaDecoderLayer, LlamaMLP
from folio.models.model_config import ModelConfig
from folio.models.moe import Experts
from folio.models.weight_loader import ShardId, uninitialized

# the checkpoint's place of a layer's correction bias, Transformers' rename of it into the router
_CORRECTION_BIAS = re.compile(r"(.+\.mlp)\.moe_statics\.(e_score_correction_bias)")


class CorrectedTopKRouter(HotPathModule):
    """ERNIE's router (see the module docstring), its weight and bias in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts = cfg.moe.num_experts
        self.weight = uninitialized(experts, cfg.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = uninitialized(1, experts, dtype=torch.float32)
        self.top_k, self.norm_min = cfg.moe.top_k, float(cfg.hf_config["moe_norm_min"])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), both [T, top_k]."""
        probs = torch.softmax(nn.functional.linear(x.float(), self.weight), dim=-1)
        experts = torch.topk(probs + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        return (weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)).to(x.dtype), experts


class Ernie4_5MoeBlock(HotPathModule):
    """The routed experts plus the shared experts where there are some, unweighted."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = CorrectedTopKRouter(cfg)
        self.experts = Experts(cfg, cfg.moe)
        shared = cfg.moe.shared_expert_intermediate_size
        self.shared_experts = LlamaMLP(cfg, shared, reduce_results=False) if shared else None
        self.tp = tensor_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)  # (the ranks' partial sums: moe.Experts)


class Ernie4_5MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but its config has no moe_num_experts")
        super().__init__(cfg, layer_idx, rotary)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return Ernie4_5MoeBlock(cfg) if cfg.moe.is_sparse(layer_idx) else LlamaMLP(cfg)


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    layer_cls = Ernie4_5MoeDecoderLayer

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        if name.startswith("model.mtp_"):
            return None
        return super().map_checkpoint_name(_CORRECTION_BIAS.sub(r"\1.gate.\2", name))
