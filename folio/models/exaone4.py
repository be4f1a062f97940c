"""LG EXAONE 4.0 (EXAONE-4.0-1.2B, -32B): Qwen3's attention (an RMSNorm over each head of q and k before RoPE) in
post-norm blocks, as Transformers' Exaone4 computes them.

  * post-norm blocks (folio.models.post_norm): each sublayer's output RMS-normalised (post_attention_layernorm,
    post_feedforward_layernorm) before its residual add;
  * hybrid attention (32B): the layers `layer_types` names sliding (three of every four) see a window of
    sliding_window tokens and use RoPE; the global ones see the whole context with no positional encoding (NoPE).
    Where sliding_window is null (1.2B) every layer is global and every layer uses RoPE. Transformers' rule, kept
    to the letter: a layer rotates q and k when the config has no sliding_window or the layer slides.
"""

from __future__ import annotations

from folio.models.layers import NoRotary, RotaryEmbedding
from folio.models.model_config import ModelConfig, sliding_windows
from folio.models.post_norm import PostNormDecoderLayer, PostNormForCausalLM
from folio.models.qwen3 import Qwen3Attention


def rope_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer, whether its attention rotates q and k. From the config's own windows, not cfg.sliding_windows,
    which drops a window no shorter than the context (the layer still slides for Transformers, and rotates)."""
    if cfg.hf_config.get("sliding_window") is None:
        return [True] * cfg.num_hidden_layers
    windows = sliding_windows(cfg.hf_config, cfg.architecture, cfg.num_hidden_layers)
    return [bool(windows) and windows[i] is not None for i in range(cfg.num_hidden_layers)]


class Exaone4DecoderLayer(PostNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        rotates = rope_layers(cfg)[layer_idx]
        super().__init__(cfg, Qwen3Attention(cfg, layer_idx, rotary if rotates else NoRotary()))


class Exaone4ForCausalLM(PostNormForCausalLM):
    layer_cls = Exaone4DecoderLayer
