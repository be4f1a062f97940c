"""DeepSeek V2 (DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2) and V3 (DeepSeek-V3, R1): the Llama
decoder with

  * multi-head latent attention, computed on the compressed latent that the KV cache keeps (folio.models.mla);
  * a mixture of experts after the first `first_k_dense_replace` dense layers: routed experts chosen by DeepSeek's
    grouped router (folio.models.grouped_topk; V2: softmax scores, V3: sigmoid scores with a bias that only
    chooses), plus `n_shared_experts` experts' worth of one ungated MLP that every token goes through.

V3's checkpoints carry a multi-token-prediction layer after the decoder's (num_nextn_predict_layers): not served,
its tensors are skipped.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.grouped_topk import GroupedTopKRouter
from folio.models.hot_path import HotPathModule
from folio.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from folio.models.mla import LatentRotaryEmbedding, MultiHeadLatentAttention
from folio.models.model_config import ModelConfig
from folio.models.moe import Experts
from folio.models.weight_loader import ShardId

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class DeepseekMoE(HotPathModule):
    """Routed experts (float32 routing weights) and the shared experts' MLP, their ranks' partial sums added once."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = self.make_router(cfg)
        self.experts = Experts(cfg, moe)
        self.shared_experts = (LlamaMLP(cfg, moe.shared_expert_intermediate_size, reduce_results=False)
                               if moe.shared_expert_intermediate_size else None)
        self.tp = tensor_parallel_group()

    def make_router(self, cfg: ModelConfig) -> nn.Module:
        """Hook for LFM2-MoE's router (folio.models.lfm2_moe)."""
        return GroupedTopKRouter(cfg.hidden_size, cfg.hf_config, cfg.moe.num_experts, cfg.moe.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = MultiHeadLatentAttention

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is not None and cfg.moe.is_sparse(layer_idx):
            return DeepseekMoE(cfg)
        return LlamaMLP(cfg)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    rotary_cls = LatentRotaryEmbedding
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        layer = _LAYER.search(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            return None  # V3's multi-token-prediction layers
        return super().map_checkpoint_name(name)
