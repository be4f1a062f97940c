"""GLM-4.5 and GLM-4.6 (GLM-4.5-Air included: Glm4MoeForCausalLM): Llama's attention with q/k/v biases, RoPE on the
first half of each head (partial_rotary_factor 0.5, on the halves of the rotated part: neox style, unlike GLM-4's
interleaved pairs) and, where use_qk_norm says so, Qwen3's per-head q/k norms; after the first
first_k_dense_replace dense layers, DeepSeek V3's mixture of experts (folio.models.deepseek_v2.DeepseekMoE: a sigmoid
router whose correction bias chooses, shared experts). Its checkpoints' multi-token-prediction layers (after the
decoder's) are skipped, as DeepSeek V3's.
"""

from __future__ import annotations

from folio.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from folio.models.layers import RotaryEmbedding
from folio.models.llama import LlamaAttention, LlamaForCausalLM
from folio.models.model_config import ModelConfig
from folio.models.qwen3 import Qwen3Attention


class Glm4MoeDecoderLayer(DeepseekV2DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        self.attention_cls = Qwen3Attention if cfg.hf_config.get("use_qk_norm") else LlamaAttention
        super().__init__(cfg, layer_idx, rotary)


class Glm4MoeForCausalLM(DeepseekV2ForCausalLM):
    layer_cls = Glm4MoeDecoderLayer
    rotary_cls = RotaryEmbedding
    stacked_params = LlamaForCausalLM.stacked_params
