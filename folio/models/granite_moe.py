"""IBM Granite MoE (Granite 3.0 / 3.1 1B-A400M and 3B-A800M: GraniteMoeForCausalLM) and Granite MoE with a shared
expert (GraniteMoeSharedForCausalLM): dense Granite's attention and four scalars (folio.models.granite) with routed
experts (folio.models.moe) in every layer.

What differs from the other mixtures of experts, as Transformers computes it:

  * the router takes the top-k logits (in float32) and softmaxes those k only, the weights then in the activations'
    dtype: the weights of a softmax over all the experts renormalised over the k, rounded as Transformers rounds;
  * the shared MLP (shared_intermediate_size > 0) takes every token, ungated, and adds to the routed experts' sum;
    the residual multiplier scales that sum;
  * the checkpoint stacks the experts: block_sparse_moe.input_linear.weight [experts, 2 * intermediate, hidden]
    (each expert's gate rows, then its up rows) and output_linear.weight [experts, hidden, intermediate]; the
    shared MLP fuses its gate and up rows likewise (shared_mlp.input_linear). `split_checkpoint_tensor` cuts them
    into the per-expert gate, up and down tensors llama.cpp's converter writes, so a Hugging Face folder and a
    GGUF file load under the same names, into the per-expert Linear layers every linear method serves.

llama.cpp has one GGUF architecture, "granitemoe", for both (the shared MLP where its size is in the file).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.granite import GraniteDecoderLayer, GraniteForCausalLM, multiplier
from folio.models.hot_path import HotPathModule
from folio.models.llama import LlamaMLP
from folio.models.model_config import ModelConfig
from folio.models.moe import Experts, Gate

# a layer's tensors named as Granite names them (the router) or holding several of folio's: (layer, block, tensor)
_FUSED_TENSOR = re.compile(r"(.+\.layers\.\d+)\.(block_sparse_moe|shared_mlp)\."
                           r"(input_linear|output_linear|router\.layer)\.weight")


class TopKSoftmaxRouter(Gate):
    """Granite's router: the top-k router logits (float32), softmaxed among themselves."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.moe.num_experts)
        self.top_k = cfg.moe.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), both [T, top_k]."""
        logits, experts = torch.topk(super().forward(x).float(), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1).to(x.dtype), experts


class GraniteMoeBlock(HotPathModule):
    """The routed experts plus the shared MLP where there is one, their sum times residual_multiplier."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopKSoftmaxRouter(cfg)
        self.experts = Experts(cfg, cfg.moe)
        shared = cfg.moe.shared_expert_intermediate_size  # (config.json's shared_intermediate_size)
        self.shared_expert = LlamaMLP(cfg, shared, reduce_results=False) if shared else None
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")
        self.tp = tensor_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out) * self.residual_multiplier  # (the ranks' partial sums: moe.Experts)


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but its config has no num_local_experts")
        return GraniteMoeBlock(cfg)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    layer_cls = GraniteMoeDecoderLayer

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the (name, tensor) pairs `map_checkpoint_name` places (folio.loader.weights):
        the router's as mlp.gate, the stacked experts' as each expert's gate_proj, up_proj and down_proj, the
        shared MLP's as mlp.shared_expert's; any other tensor as it is."""
        match = _FUSED_TENSOR.fullmatch(name)
        if match is None:
            return ((name, tensor),)
        layer, block, part = match.groups()
        if part == "router.layer":
            return ((f"{layer}.mlp.gate.weight", tensor),)
        mlps = ({f"{layer}.mlp.shared_expert": tensor} if block == "shared_mlp" else
                {f"{layer}.mlp.experts.{e}": expert for e, expert in enumerate(tensor)})
        if part == "output_linear":
            return [(f"{mlp}.down_proj.weight", w) for mlp, w in mlps.items()]
        return [(f"{mlp}.{proj}.weight", rows) for mlp, w in mlps.items()
                for proj, rows in zip(("gate_proj", "up_proj"), w.chunk(2))]
