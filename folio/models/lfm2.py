"""LFM2 (Liquid AI's LFM2-350M, 700M, 1.2B, 2.6B: Lfm2ForCausalLM): a hybrid of gated short convolutions and
grouped-query attention, the layer_types of its config saying which ("conv" / "full_attention").

  * a convolution layer: in_proj gives B, C and x (hidden_size channels each); y = C * conv(B * x), where conv is a
    causal depthwise convolution over the last conv_L_cache tokens of each channel (kernel 3 in every release), then
    out_proj. What a request carries from token to token is the last conv_L_cache - 1 values of B * x per channel: a
    recurrent state (folio.models.recurrent_state), kept per request by the model runner instead of K/V in the
    paged cache, which only the attention layers use;
  * an attention layer: Qwen3's (per-head RMSNorms of q and k before RoPE, no biases);
  * Llama's SwiGLU MLP (w1, w3, w2), of the width Lfm2MLP derives from the config (model_config.lfm2_fields), and
    pre-norm blocks with a final norm (embedding_norm); tied embeddings.

Tensor parallelism: each rank computes its share of the convolutions' channels (in_proj by columns of B, C and x,
the kernel's rows, out_proj by rows) and of the attention heads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.causal_conv import CausalDepthwiseConv
from folio.models.hot_path import HotPathModule
from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.linear import Linear
from folio.models.llama import LlamaForCausalLM, LlamaMLP, StepContext
from folio.models.model_config import ModelConfig
from folio.models.qwen3 import Qwen3Attention
from folio.models.recurrent_state import StateShapes
from folio.models.weight_loader import ALL_SHARDS, ShardId

_RENAMES = ((".feed_forward.", ".mlp."), (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."), ("embedding_norm.", "norm."))


class ShortConv(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.channels = cfg.hidden_size // tensor_parallel_group().size
        self.taps = int(cfg.hf_config["conv_L_cache"])
        bias = bool(cfg.hf_config.get("conv_bias", False))
        self.in_proj = Linear(cfg.hidden_size, {"B": self.channels, "C": self.channels, "x": self.channels},
                              bias=bias, parallel="column")
        self.conv = CausalDepthwiseConv(self.channels, self.taps, bias)
        self.out_proj = Linear(self.channels, cfg.hidden_size, bias=bias, parallel="row")

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = b * v  # [T, channels]
        step = ctx.recurrent
        (state,) = step.states[self.layer_idx]  # [rows, channels, taps - 1]: each request's last B * x values
        if step.decodes_only:
            out = self.conv.decodes(bx, state, step.rows)
        else:
            out, start = torch.empty_like(bx), 0
            for row, n in zip(step.rows.tolist(), step.query_lens):
                out[start:start + n] = self.conv.tokens(bx[start:start + n], state, row)
                start += n
        return self.out_proj(c * out)


class Lfm2DecoderLayer(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        recurrent = layer_idx in cfg.recurrent_layers
        self.conv = ShortConv(cfg, layer_idx) if recurrent else None
        # an attention layer's KV cache is its place among the layers that keep one
        self.self_attn = None if recurrent else Qwen3Attention(cfg, cfg.kv_cache_layers.index(layer_idx), rotary)
        self.mlp = self.make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Hook for LFM2-MoE's sparse layers (folio.models.lfm2_moe)."""
        return LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], ctx: StepContext):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.conv(x, ctx) if self.conv is not None else self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Lfm2ForCausalLM(LlamaForCausalLM):
    layer_cls = Lfm2DecoderLayer
    stacked_params = {**LlamaForCausalLM.stacked_params, "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                      "w2": ("down_proj", None), "in_proj": ("in_proj", ALL_SHARDS)}

    def recurrent_state_shapes(self) -> StateShapes:
        """Per convolution layer, its state for one request: the last conv_L_cache - 1 values of B * x of each of
        the rank's channels."""
        return {i: (layer.conv.conv.state_shape,)
                for i, layer in enumerate(self.layers) if layer.conv is not None}

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().map_checkpoint_name(name)
