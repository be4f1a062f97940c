"""Qwen3-MoE: the Qwen3 decoder (q/k norms) with routed experts, renormalised by norm_topk_prob (folio.models.moe)."""

from __future__ import annotations

from folio.models.llama import LlamaForCausalLM
from folio.models.moe import MoEDecoderLayer
from folio.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
