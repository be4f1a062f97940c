"""Mixtral: the Mistral decoder with a top-2 mixture of experts in every layer (folio.models.moe).

Its checkpoints name the block `block_sparse_moe` and an expert's gate, down and up projections w1, w2, w3.
"""

from __future__ import annotations

from typing import Optional

from folio.models.llama import LlamaForCausalLM
from folio.models.moe import MoEDecoderLayer
from folio.models.weight_loader import ShardId


class MixtralDecoderLayer(MoEDecoderLayer):
    float_weights = True  # Transformers' Mixtral router keeps its renormalised weights in float32


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    stacked_params = {**LlamaForCausalLM.stacked_params,
                      "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        return super().map_checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))
