"""Baidu ERNIE 4.5, dense (ERNIE-4.5-0.3B): the Llama decoder whose RoPE rotates interleaved channel pairs.

Transformers' Ernie4_5 rotates each head's channels (2i, 2i + 1) by position * inv_freq[i] (GPT-J's layout, llama.cpp's
"normal" RoPE, folio.models.layers.InterleavedRotaryEmbedding) where Llama rotates (i, i + head_dim / 2). It rotates
in float32 whatever the model's dtype; folio rotates in the model's dtype, as for Llama: the same numbers in
float32, within a bf16 rounding of q and k in bf16. Its head_dim (128) is not hidden_size / heads (64), and its
lm_head is tied by default (folio.models.model_config.HF_DEFAULTS). `use_bias` would put biases on every projection;
no released dense ERNIE 4.5 has them, and folio refuses such a config. The MoE models (Ernie4_5_MoeForCausalLM)
are another architecture.
"""

from __future__ import annotations

from folio.models.layers import InterleavedRotaryEmbedding
from folio.models.llama import LlamaForCausalLM
from folio.models.model_config import ModelConfig


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    rotary_cls = InterleavedRotaryEmbedding

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.hf_config.get("use_bias"):
            raise ValueError(f"{cfg.architecture} with use_bias (biases on every projection) is not supported")
        super().__init__(cfg, max_positions)
