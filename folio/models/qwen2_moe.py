"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder with routed experts plus a sigmoid-gated shared
expert (folio.models.moe); layers listed in mlp_only_layers keep a dense MLP."""

from __future__ import annotations

from folio.models.llama import LlamaForCausalLM
from folio.models.moe import MoEDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layer_cls = MoEDecoderLayer
