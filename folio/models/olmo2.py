"""OLMo 2 and OLMo 3 (AllenAI): the Llama decoder with OLMo's norms, as Transformers computes them.

  * post-norm blocks (folio.models.post_norm): no norm before attention or the MLP; an RMSNorm of each one's output
    before its residual add (post_attention_layernorm, post_feedforward_layernorm);
  * an RMSNorm over the whole q projection and one over the whole k projection (all heads together, not per head
    as Qwen3's), before RoPE;
  * every RMSNorm multiplies by its weight in float32 and rounds once to the model's dtype (Llama's rounds first,
    then multiplies): the same numbers as Llama's in float32, not in bf16;
  * OLMo 3: sliding-window attention on the layers `layer_types` says (by default three of every four), whose
    RoPE has a base of its own and no scaling (the full layers' rope_scaling, YaRN in the released models, is
    theirs alone); folio.models.model_config.text_config reads both from the config.

Tensor parallelism: a rank holds its heads' slice of q and k, so the norms over the whole projections sum each
token's squares over the ranks (one all-reduce of two floats a token per layer, q's and k's together) and each
rank scales its slice by its part of the weights.
"""

from __future__ import annotations

import torch

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.hot_path import HotPathModule
from folio.models.layers import RotaryEmbedding
from folio.models.linear import Linear, load_rank_rows
from folio.models.llama import LlamaAttention
from folio.models.model_config import ModelConfig
from folio.models.post_norm import PostNormDecoderLayer, PostNormForCausalLM
from folio.models.weight_loader import uninitialized


class Olmo2RMSNorm(HotPathModule):
    """weight * (x * rsqrt(mean(x^2) + eps)) in float32, rounded once to x's dtype (Transformers' Olmo2RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(size)
        self.eps = eps

    def scale(self, h: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """h (float32) normalised by its mean square ([..., 1]), in float32: the caller rounds."""
        return self.weight * (h * torch.rsqrt(mean_square + self.eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.scale(h, h.pow(2).mean(-1, keepdim=True)).to(x.dtype)


class ProjectionRMSNorm(Olmo2RMSNorm):
    """Olmo2RMSNorm over a whole q or k projection, of which this tensor-parallel rank holds `size` channels: its
    heads', each kept by `replicas` ranks (KV heads fewer than ranks). The weight loads as the rank's slice; the
    mean square is the sum of the squares over the ranks divided by `total`, the channels they hold together (a
    replicated head is counted as often as it is summed)."""

    def __init__(self, size: int, eps: float, replicas: int = 1) -> None:
        super().__init__(size, eps)
        self.total = size * tensor_parallel_group().size
        load_rank_rows(self.weight, replicas)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with the q and k norms over the whole projections and an o_proj bias where q/k/v have
    one (Transformers' attention_bias covers all four)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        if cfg.attention_bias:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=True, parallel="row")
        self.q_norm = ProjectionRMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = ProjectionRMSNorm(self.kv_size, cfg.rms_norm_eps, cfg.kv_head_replicas)
        self.tp = tensor_parallel_group()

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        hq, hk = q.reshape(tokens, -1).float(), k.reshape(tokens, -1).float()
        # each token's sums of squares, q's and k's in one all-reduce (none on a single rank, where the sum divided
        # by the channel count is Transformers' mean to the bit)
        squares = self.tp.all_reduce(torch.stack((hq.pow(2).sum(-1), hk.pow(2).sum(-1)), dim=-1))
        return (self.q_norm.scale(hq, squares[:, :1] / self.q_norm.total).to(q.dtype).view(q.shape),
                self.k_norm.scale(hk, squares[:, 1:] / self.k_norm.total).to(k.dtype).view(k.shape))


class Olmo2DecoderLayer(PostNormDecoderLayer):
    norm_cls = Olmo2RMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, Olmo2Attention(cfg, layer_idx, rotary))


class Olmo2ForCausalLM(PostNormForCausalLM):
    layer_cls = Olmo2DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2 with sliding layers, whose RoPE (rope_local_base_freq, rope_local_scaling) is their own; which
    layers slide is the layer type's call, so a window no shorter than the context keeps its layer's RoPE."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        hf = cfg.hf_config
        local = RotaryEmbedding.for_model(cfg, max_positions, float(hf["rope_local_base_freq"]),
                                          hf.get("rope_local_scaling"))
        for layer, kind in zip(self.layers, hf["layer_types"]):
            if kind == "sliding_attention":
                layer.self_attn.rotary = local
