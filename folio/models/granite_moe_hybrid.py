"""IBM Granite 4.0-H (granite-4.0-h-micro, h-tiny, h-small: GraniteMoeHybridForCausalLM): Mamba2 mixers
(folio.models.mamba2) and a few attention layers, the config's layer_types saying which ("mamba" / "attention", as
Transformers 5 writes them "linear_attention" / "full_attention": model_config.granite_hybrid_fields).

  * Granite's four scalars (folio.models.granite): the embedding multiplier, attention_multiplier as the softmax
    scale, the residual multiplier on every mixer's (Mamba2's or attention's) and feed-forward's output, and the
    logits divided by logits_scaling;
  * the attention layers rotate q and k only where position_embedding_type is "rope": Granite 4.0-H says "nope"
    (Transformers builds no rotary embedding for anything but "rope");
  * the feed-forward: Granite MoE's routed experts plus the shared MLP (h-tiny, h-small: folio.models.granite_moe),
    or, with num_local_experts 0 (h-micro), the shared MLP alone, of shared_intermediate_size. Both load from the
    checkpoint's block_sparse_moe.* and shared_mlp.* as Granite MoE's do.

The Mamba2 layers keep a recurrent state per request (folio.models.recurrent_state), the attention layers K/V in
the paged cache. Tensor parallelism is refused (folio.models.mamba2).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.models.granite import GraniteAttention, multiplier
from folio.models.granite_moe import GraniteMoeBlock, GraniteMoeForCausalLM
from folio.models.hot_path import HotPathModule
from folio.models.layers import NoRotary, RMSNorm, RotaryEmbedding
from folio.models.llama import LlamaMLP, StepContext
from folio.models.mamba2 import Mamba2Mixer
from folio.models.model_config import ModelConfig
from folio.models.recurrent_state import StateShapes


class GraniteSharedMLP(HotPathModule):
    """A dense Granite 4.0-H's feed-forward: the shared MLP alone, named as GraniteMoeBlock's (so that both load
    from shared_mlp.*), times residual_multiplier."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.shared_expert = LlamaMLP(cfg, int(cfg.hf_config["shared_intermediate_size"]))
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x) * self.residual_multiplier


class GraniteMoeHybridDecoderLayer(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        recurrent = layer_idx in cfg.recurrent_layers
        self.mamba = Mamba2Mixer(cfg, layer_idx) if recurrent else None
        # an attention layer's KV cache is its place among the layers that keep one
        self.self_attn = None if recurrent else GraniteAttention(cfg, cfg.kv_cache_layers.index(layer_idx), rotary)
        self.mlp = GraniteMoeBlock(cfg) if cfg.moe is not None else GraniteSharedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")  # (GraniteAttention applies its own)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], ctx: StepContext):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.mamba is not None:
            x = self.mamba(x, ctx) * self.residual_multiplier
        else:
            x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    layer_cls = GraniteMoeHybridDecoderLayer

    @property
    def rotary_cls(self) -> type[nn.Module]:
        """RoPE only where the config asks for it (read while the base class builds the layers)."""
        rope = self.config.hf_config.get("position_embedding_type") == "rope"
        return RotaryEmbedding if rope else NoRotary

    def recurrent_state_shapes(self) -> StateShapes:
        """Per Mamba2 layer, its states for one request (Mamba2Mixer.state_shapes)."""
        return {i: layer.mamba.state_shapes() for i, layer in enumerate(self.layers) if layer.mamba is not None}
