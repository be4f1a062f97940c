"""Multi-head latent attention (MLA: DeepSeek V2 and V3), computed on the compressed latent.

Each token's keys and values come from one latent: kv_a_proj_with_mqa gives a row c (kv_lora_rank wide, then
RMS-normalised) and a key part k_pe (qk_rope_head_dim wide, rotated, shared by every head); per head h,
kv_b_proj's rows expand c into k_nope[h] = W_UK[h] c and v[h] = W_UV[h] c. Queries split the same way into q_nope
and a rotated q_pe. So

    score[h] = q_nope[h] . W_UK[h] c + q_pe[h] . k_pe = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe
    out[h]   = W_UV[h] (sum over keys of p[h] c)

and the attention runs on the latent, as DeepSeek's own inference does ("absorbed" weights): the query of head h is
[W_UK[h]^T q_nope[h], q_pe[h]], every head attends to one shared key row [c, k_pe] (multi-query attention,
kv_lora_rank + qk_rope_head_dim wide: 576 for DeepSeek's 512 + 64), and the values are those same rows, whose first
kv_lora_rank channels of the output W_UV[h] then maps to the head's value. The paged KV cache holds that one row a
token (folio.models.model_config.text_config sets the cache's geometry to one KV head of that width) instead of the
heads' expanded keys and values: 1152 bytes a token and layer in bf16 for DeepSeek-V2-Lite's 16 heads against 10240.
The attention seam takes K and V as a pair: the cache's V is its K, one tensor (ModelConfig.values_are_keys), so a
row is stored once and the kernels' second read of it comes from the CPU's caches.

kv_b_proj stays out of the linear methods (a `Gate`, full precision): its two halves are multiplied into the
queries and outputs per head (batched matrix products), not applied as a layer.

Tensor parallelism: each rank computes its heads (q_proj / q_b_proj by columns, kv_b_proj's rows of its heads,
o_proj by rows); the latent projection and the cache row are the same on every rank.
"""

from __future__ import annotations

import math

import torch

from folio.attention.backend import AttentionParams
from folio.models.hot_path import HotPathModule
from folio.models.layers import InterleavedRotaryEmbedding, RMSNorm, RotaryEmbedding
from folio.models.linear import Linear, load_rank_rows
from folio.models.llama import StepContext
from folio.models.model_config import ModelConfig
from folio.models.moe import Gate
from folio.models.rope_scaling import rope_type


def yarn_softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """qk_head_dim^-1/2, times mscale^2 under YaRN with mscale_all_dim (Transformers' yarn_apply_mscale): DeepSeek's
    long-context checkpoints sharpen the softmax as well as the rotary tables."""
    scale = qk_head_dim ** -0.5
    scaling = cfg.rope_scaling or {}
    if rope_type(cfg.rope_scaling) != "default" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentRotaryEmbedding:
    """The rotary embedding of q_pe and k_pe (qk_rope_head_dim channels, all rotating): DeepSeek's on interleaved
    pairs unless a V3 config says rope_interleave: false."""

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_positions: int, theta: float, scaling) -> RotaryEmbedding:
        dim = int(cfg.hf_config["qk_rope_head_dim"])
        kind = InterleavedRotaryEmbedding if cfg.hf_config.get("rope_interleave", True) else RotaryEmbedding
        return kind(dim, max_positions, theta, scaling, dim, cfg.max_position_embeddings)


class MultiHeadLatentAttention(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads  # of this rank
        self.nope, self.rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.kv_rank = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        q_size = self.num_heads * (self.nope + self.rope)
        q_rank = hf.get("q_lora_rank")
        if q_rank:  # V3, V2 (not Lite): queries through a low-rank bottleneck of their own
            self.q_a_proj = Linear(cfg.hidden_size, int(q_rank), bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(int(q_rank), cfg.rms_norm_eps)
            self.q_b_proj = Linear(int(q_rank), q_size, parallel="column")
        else:
            self.q_a_proj = None
            self.q_proj = Linear(cfg.hidden_size, q_size, parallel="column")
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Gate(self.kv_rank, self.num_heads * (self.nope + self.v_dim))
        load_rank_rows(self.kv_b_proj.weight)
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias, parallel="row")
        self.rotary = rotary
        self.attn_params = AttentionParams(scale=yarn_softmax_scale(cfg, self.nope + self.rope))
        self.w_uk = self.w_uv = None  # [H, nope, rank] and [H, rank, v_dim], from kv_b_proj once it is loaded

    def process_weights_after_loading(self) -> None:
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        self.w_uk = w[:, :self.nope].contiguous()
        self.w_uv = w[:, self.nope:].transpose(1, 2).contiguous()
        del self.kv_b_proj  # its two halves are all the forward reads

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q = self.q_proj(x) if self.q_a_proj is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat([q_latent, q_pe], dim=-1)
        row = torch.cat([self.kv_a_layernorm(latent.contiguous()), k_pe.squeeze(1)], dim=-1).unsqueeze(1)
        out = ctx.attend(self.layer_idx, query, row, row, self.attn_params)  # [T, H, rank + rope]
        values = torch.bmm(out[..., :self.kv_rank].transpose(0, 1), self.w_uv)  # [H, T, v_dim]
        return self.o_proj(values.transpose(0, 1).reshape(-1, self.num_heads * self.v_dim))
