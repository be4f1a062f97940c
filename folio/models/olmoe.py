"""OLMoE: the Llama decoder with routed experts (folio.models.moe) and RMSNorms over the whole q and k projections
(not per head, as Qwen3's), applied before RoPE.

Tensor parallelism: a rank holds its heads' slice of q and k (and of the norms' weights), so each token's squares
are summed across the ranks (one all-reduce of two floats a token per layer, as OLMo 2's, folio.models.olmo2); the
normalised slice is rounded, then weighted, as Transformers' OlmoeRMSNorm (Llama's order). One rank keeps the fused
norm kernel.
"""

from __future__ import annotations

import torch

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.linear import load_rank_rows
from folio.models.llama import LlamaAttention, LlamaForCausalLM
from folio.models.model_config import ModelConfig
from folio.models.moe import MoEDecoderLayer


class OlmoeAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.tp = tensor_parallel_group()
        if self.tp.size > 1:
            load_rank_rows(self.q_norm.weight)
            load_rank_rows(self.k_norm.weight, cfg.kv_head_replicas)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        hq, hk = q.reshape(tokens, -1), k.reshape(tokens, -1)
        if self.tp.size == 1:
            return self.q_norm(hq).view(q.shape), self.k_norm(hk).view(k.shape)
        hq, hk = hq.float(), hk.float()
        squares = self.tp.all_reduce(torch.stack((hq.pow(2).sum(-1), hk.pow(2).sum(-1)), dim=-1))
        means = squares / torch.tensor([hq.shape[1] * self.tp.size, hk.shape[1] * self.tp.size])
        return tuple((h * torch.rsqrt(mean.unsqueeze(-1) + norm.eps)).to(x.dtype).mul_(norm.weight).view(x.shape)
                     for x, h, mean, norm in ((q, hq, means[:, 0], self.q_norm), (k, hk, means[:, 1], self.k_norm)))


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
