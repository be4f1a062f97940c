"""SmolLM3: the Llama decoder where some layers use no positional encoding (NoPE) at all.

Its config lists, per layer, whether RoPE applies (`no_rope_layers`: 1 = rotate, 0 = NoPE, despite the name), or
gives `no_rope_layer_interval` (default 4): then every fourth layer (3, 7, 11, ...) is NoPE, as Transformers'
SmolLM3Config fills the list in. A NoPE layer's queries and keys enter attention, and its KV cache, unrotated.
"""

from __future__ import annotations

from typing import Any

from folio.models.layers import NoRotary, RotaryEmbedding
from folio.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from folio.models.model_config import ModelConfig


def rope_layers(hf_config: dict[str, Any], num_layers: int) -> list[bool]:
    """Per layer, whether its attention rotates q and k (Transformers' SmolLM3Config.no_rope_layers)."""
    flags = hf_config.get("no_rope_layers")
    if flags is None:
        interval = int(hf_config.get("no_rope_layer_interval") or 4)
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, the model has {num_layers}")
    return [bool(flag) for flag in flags]


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        uses_rope = rope_layers(cfg.hf_config, cfg.num_hidden_layers)[layer_idx]
        super().__init__(cfg, layer_idx, rotary if uses_rope else NoRotary())


class SmolLM3ForCausalLM(LlamaForCausalLM):
    layer_cls = SmolLM3DecoderLayer
