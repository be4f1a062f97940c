"""OLMoE: the Llama decoder with routed experts (folio.models.moe) and RMSNorms over the whole q and k projections
(not per head, as Qwen3's), applied before RoPE."""

from __future__ import annotations

import torch

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.llama import LlamaAttention, LlamaForCausalLM
from folio.models.model_config import ModelConfig
from folio.models.moe import MoEDecoderLayer


class OlmoeAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        if tensor_parallel_group().size > 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_group().size}: OLMoE's q and k norms span every "
                             "head, which ranks split; it runs on one rank")
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        return (self.q_norm(q.reshape(tokens, -1)).view(q.shape),
                self.k_norm(k.reshape(tokens, -1)).view(k.shape))


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
