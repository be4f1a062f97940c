"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder, with q/k/v and gate/up fused in the checkpoint too.

The fused checkpoint tensors load whole into folio's fused layers: their shard id `ALL_SHARDS` has the loading
loop cut them into the layers' declared shards, so each linear method loads shards as for any other model.
Partial rotary (Phi-4-mini's partial_rotary_factor) and LongRoPE come from the config (folio.models.layers).
"""

from __future__ import annotations

from folio.models.llama import LlamaForCausalLM
from folio.models.weight_loader import ALL_SHARDS


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params = {"qkv_proj": ("qkv_proj", ALL_SHARDS), "gate_up_proj": ("gate_up_proj", ALL_SHARDS)}
