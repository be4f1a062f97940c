"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's top-k
experts.

Each expert is declared as a gated MLP of ordinary Linear layers, so every linear method (dense, int8, int4, GGUF
blocks) loads experts unchanged, and `bind_linear_methods` binds them like any layer. After loading,
`experts_method` decides how they run, in that one place: unquantised float32 / bf16 experts are stacked and run
fused, one C++ call per layer (folio.models.fused_moe); quantised ones keep the per-expert path
(folio.models.experts_method.PerExpertMethod). Both group a step's (token, slot) choices by expert (a stable
sort) and run each chosen expert once on all of its tokens: an expert's weights are read at most once per step
whatever the batch, and an expert no token chose is not read at all.

GPT-OSS's experts (folio.models.gpt_oss) have biases on gate/up and down and their own activation
(experts_method.ClampedSwiGLU): `ClampedSwiGLUExpert`, which both methods run.

Routing follows Transformers exactly: softmax in float32 over the router logits, top-k, renormalised to sum 1
where the model does (Mixtral always, Qwen and OLMoE by norm_topk_prob); Qwen and OLMoE cast the weights back to
the activations' dtype, Mixtral keeps them in float32. Qwen2-MoE adds a shared expert that every token goes
through, scaled by a sigmoid gate. The router and that gate are small `Gate` projections, not Linear layers: a
quantisation scheme keeps them in full precision, as routing decisions are the most sensitive numbers of the block.

Under tensor parallelism every rank keeps its columns of every expert (gate/up rows, down columns: vLLM's
tensor-parallel experts), routes all tokens with the whole router, and the block sums the ranks' partial outputs
once, all experts and the shared one together, rather than once per expert.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models import fused_moe
from folio.models.experts_method import ClampedSwiGLU, ExpertsMethod, PerExpertMethod
from folio.models.hot_path import HotPathModule
from folio.models.linear import Linear
from folio.models.llama import LlamaDecoderLayer, LlamaMLP
from folio.models.model_config import ModelConfig, MoEConfig
from folio.models.weight_loader import uninitialized


class Gate(HotPathModule):
    """A small full-precision projection (router logits, the shared expert's gate), outside the linear methods."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = uninitialized(output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class TopKRouter(Gate):
    def __init__(self, cfg: ModelConfig, float_weights: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.moe.num_experts)
        self.top_k, self.normalize, self.float_weights = cfg.moe.top_k, cfg.moe.norm_topk_prob, float_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), both [T, top_k]."""
        logits = super().forward(x)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(logits.dtype)), experts


class ClampedSwiGLUExpert(HotPathModule):
    """A GPT-OSS expert: gate/up (two shards, gates first, as LlamaMLP's) and down with biases, and the clamped
    SwiGLU between them."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int, activation: ClampedSwiGLU) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, {0: intermediate_size, 1: intermediate_size}, bias=True,
                                   parallel="column")
        self.down_proj = Linear(intermediate_size, cfg.hidden_size, bias=True, parallel="row", reduce_results=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate, up))


class Experts(nn.ModuleList):
    """The routed experts of one layer, declared as LlamaMLPs (or, with a clamped SwiGLU `activation`,
    ClampedSwiGLUExperts), so every linear method loads them, and run by an ExpertsMethod chosen after loading
    (`experts_method`). Under tensor parallelism an expert's output is the rank's partial sum: its block adds the
    ranks' up. runs[e] counts expert e's runs, each one read of its weights: the step profile
    (folio.bench.step_profile) reports them per step."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, activation: Optional[ClampedSwiGLU] = None) -> None:
        super().__init__(LlamaMLP(cfg, moe.intermediate_size, reduce_results=False) if activation is None
                         else ClampedSwiGLUExpert(cfg, moe.intermediate_size, activation)
                         for _ in range(moe.num_experts))
        self.activation = activation
        self.num_experts = moe.num_experts
        self.runs = torch.zeros(moe.num_experts, dtype=torch.int64)
        self.method: ExpertsMethod = PerExpertMethod()

    def process_weights_after_loading(self) -> None:
        """Called before the experts' linear methods process their weights (folio.models.linear)."""
        self.method = experts_method(self)
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out, rows = self.method.apply(self, x, weights, experts)
        self.runs += rows > 0
        return out


def experts_method(experts: Experts) -> ExpertsMethod:
    """The one place that decides how a layer's experts run: fused where their linear method keeps plain
    float32 / bf16 weights (dense) and the kernel builds, else one by one through their linear methods
    (int8, int4, GGUF blocks, other dtypes)."""
    layers = [layer for mlp in experts for layer in (mlp.gate_up_proj, mlp.down_proj)]
    return fused_moe.FusedExpertsMethod(layers[0].params_dtype) if fused_moe.supports(layers) else PerExpertMethod()


class SparseMoeBlock(HotPathModule):
    def __init__(self, cfg: ModelConfig, float_weights: bool) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = TopKRouter(cfg, float_weights)
        self.experts = Experts(cfg, moe)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, moe.shared_expert_intermediate_size, reduce_results=False)
            self.shared_expert_gate = Gate(cfg.hidden_size, 1)
        self.tp = tensor_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)  # the ranks' partial sums of every expert: one sum for the block


class MoEDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose feed-forward is a SparseMoeBlock where the config makes the layer sparse.
    float_weights: whether routing weights stay float32 (Mixtral) or take the activations' dtype (Qwen)."""

    float_weights = False

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but its config has no num_experts "
                             "(or num_local_experts)")
        return SparseMoeBlock(cfg, self.float_weights) if cfg.moe.is_sparse(layer_idx) else LlamaMLP(cfg)
