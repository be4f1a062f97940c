"""Cohere 2 (Command R7B, Command A: Cohere2ForCausalLM): Cohere's model (folio.models.cohere) with hybrid attention,
as Transformers' Cohere2 computes it.

  * the layers `layer_types` names sliding (by default three of every four: sliding_window_pattern 4) see a window
    of sliding_window tokens and rotate q and k; the global ones see the whole context with no positional encoding
    (NoPE). Transformers' rule, to the letter: a layer rotates when it slides and the config has a sliding_window, so
    with a null sliding_window no layer rotates;
  * no q/k norms, and a head_dim of hidden_size / num_attention_heads whatever config.json says (Cohere2Config sets
    it so): a config asking for q/k norms or another head_dim is refused, as is a rotary_pct (older configs' field,
    which Transformers ignores and llama.cpp's converter reads) other than 1.
"""

from __future__ import annotations

from folio.models.cohere import CohereDecoderLayer, CohereForCausalLM
from folio.models.layers import NoRotary, RotaryEmbedding
from folio.models.model_config import ModelConfig, sliding_windows


def rope_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer, whether its attention rotates q and k: whether it slides by the config's own windows, not
    cfg.sliding_windows, which drops a window no shorter than the context (the layer still slides for Transformers,
    and rotates)."""
    windows = sliding_windows(cfg.hf_config, cfg.architecture, cfg.num_hidden_layers)
    return [bool(windows) and windows[i] is not None for i in range(cfg.num_hidden_layers)]


class Cohere2DecoderLayer(CohereDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary if rope_layers(cfg)[layer_idx] else NoRotary())


class Cohere2ForCausalLM(CohereForCausalLM):
    layer_cls = Cohere2DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        hf = cfg.hf_config
        if hf.get("use_qk_norm"):
            raise ValueError(f"{cfg.architecture} with use_qk_norm is not supported (Transformers' Cohere2 has no "
                             "q/k norms)")
        head_dim = cfg.hidden_size // int(hf["num_attention_heads"])  # (cfg: a tensor-parallel rank's heads)
        if cfg.head_dim != head_dim:
            raise ValueError(f"{cfg.architecture}: head_dim {cfg.head_dim} is not supported (Transformers' Cohere2 "
                             f"uses hidden_size / num_attention_heads, {head_dim})")
        if hf.get("rotary_pct", 1.0) != 1.0:
            raise ValueError(f"{cfg.architecture}: rotary_pct {hf['rotary_pct']} is not supported (every channel of "
                             "a head rotates)")
        super().__init__(cfg, max_positions)
