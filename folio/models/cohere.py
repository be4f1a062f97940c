"""Cohere Command-R (c4ai-command-r, Command R+, Aya 23, Aya Expanse: CohereForCausalLM), as Transformers' Cohere
computes it.

  * LayerNorm, not RMSNorm: mean-centred, scaled by a weight, no bias (layer_norm_eps), in float32 and rounded once
    to the model's dtype;
  * parallel blocks: one norm per layer, whose output feeds the attention and the MLP side by side,
    x + attention(n) + mlp(n);
  * RoPE on interleaved channel pairs (2i, 2i + 1), GPT-J style (folio.models.layers.InterleavedRotaryEmbedding):
    Transformers' repeat_interleave of the frequencies with its pairwise rotate_half. Transformers rotates in float32
    whatever the model's dtype, folio in the model's: the same numbers in float32;
  * use_qk_norm (Command R+): a LayerNorm over each head of q and of k before RoPE, with a weight of its own per head
    ([heads, head_dim]: under tensor parallelism each rank loads its heads' rows);
  * the logits multiplied by logit_scale; a tied lm_head (Transformers' CohereConfig defaults, and a RoPE base of
    500000: folio.models.model_config).

What the code does not compute is refused by name rather than ignored: a partial rotary factor (Transformers' Cohere
rotates whole heads), a logit_scale that is not a positive number, an activation other than SiLU.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from folio.models.hot_path import HotPathModule
from folio.models.layers import InterleavedRotaryEmbedding, RotaryEmbedding
from folio.models.linear import Linear, load_rank_rows
from folio.models.llama import LlamaAttention, LlamaMLP, StepContext
from folio.models.model_config import ModelConfig
from folio.models.post_norm import PostNormForCausalLM
from folio.models.weight_loader import uninitialized
from folio.sample.sampling_ops import argmax_rows


def config_float(cfg: ModelConfig, name: str) -> float:
    """A number the config must state (its architecture's default fills it in where left out): Transformers' Cohere
    fails on a null one, folio says which."""
    value = cfg.hf_config.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{cfg.architecture}: {name} must be a number, got {value!r}")
    return float(value)


class CohereLayerNorm(HotPathModule):
    """weight * (x - mean) * rsqrt(var + eps) over the last dim, in float32, rounded once to x's dtype (Transformers'
    CohereLayerNorm). shape: the weight's, [..., dim] (a q/k norm's weight has a row per head)."""

    def __init__(self, shape: Union[int, tuple[int, ...]], eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(*((shape,) if isinstance(shape, int) else shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class CohereAttention(LlamaAttention):
    """Llama's attention with an o_proj bias where q/k/v have one (attention_bias covers all four) and, with
    use_qk_norm, per-head LayerNorms of q and k."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__(cfg, layer_idx, rotary)
        if cfg.attention_bias:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=True, parallel="row")
        self.q_norm = self.k_norm = None
        if qk_norm:
            eps = config_float(cfg, "layer_norm_eps")
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps)
            load_rank_rows(self.q_norm.weight)
            load_rank_rows(self.k_norm.weight, cfg.kv_head_replicas)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (q, k) if self.q_norm is None else (self.q_norm(q), self.k_norm(k))


class CohereDecoderLayer(HotPathModule):
    """One LayerNorm feeding the attention and the MLP in parallel; both outputs join the residual stream, the
    attention's first (Transformers' order of the sums)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = CohereAttention(cfg, layer_idx, rotary, bool(cfg.hf_config.get("use_qk_norm")))
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, config_float(cfg, "layer_norm_eps"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(positions, h, ctx) + self.mlp(h)


class CohereForCausalLM(PostNormForCausalLM):
    """PostNormForCausalLM's forward (layers that carry the residual stream themselves, a final norm) with Cohere's
    layers, LayerNorm and scaled logits."""

    layer_cls = CohereDecoderLayer
    rotary_cls = InterleavedRotaryEmbedding

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.partial_rotary_factor != 1.0:
            raise ValueError(f"{cfg.architecture}: partial_rotary_factor {cfg.partial_rotary_factor} is not supported "
                             "(Transformers' Cohere rotates whole heads)")
        logit_scale = config_float(cfg, "logit_scale")
        if not logit_scale > 0:  # a negative scale would turn the head's argmax into its argmin
            raise ValueError(f"{cfg.architecture}: logit_scale must be positive, got {logit_scale}")
        super().__init__(cfg, max_positions)
        self.logit_scale = logit_scale
        self.norm = CohereLayerNorm(cfg.hidden_size, config_float(cfg, "layer_norm_eps"))
        # multiplying by a power of two is exact, so it keeps the head's order, ties included (Command-R's 0.0625);
        # another factor (Command R+'s 0.8333) may round two logits the head ranked apart to a tie
        self.exact_scale = math.frexp(self.logit_scale)[0] == 0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.logit_scale

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax(compute_logits(hidden), dim=-1), int64: the head's own argmax where the scale keeps its order
        exactly, else the scaled logits' (Transformers' greedy picks the first of tied logits)."""
        if self.exact_scale:
            return self.lm_head.argmax(hidden)
        return argmax_rows(self.compute_logits(hidden))
