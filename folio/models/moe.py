"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's top-k
experts.

Each expert is a gated MLP of ordinary Linear layers, so every linear method (dense oneDNN-packed bf16, int8,
int4, GGUF blocks) serves experts unchanged, and `bind_linear_methods` binds them like any layer. A step groups
its tokens by expert (one stable sort of the (token, slot) choices) and runs each chosen expert once on all of
its tokens (index_select in, weighted index_add out): an expert's weights are read at most once per step
whatever the batch, and an expert no token chose is not read at all.

Routing follows Transformers exactly: softmax in float32 over the router logits, top-k, renormalised to sum 1
where the model does (Mixtral always, Qwen and OLMoE by norm_topk_prob); Qwen and OLMoE cast the weights back to
the activations' dtype, Mixtral keeps them in float32. Qwen2-MoE adds a shared expert that every token goes
through, scaled by a sigmoid gate. The router and that gate are small `Gate` projections, not Linear layers: a
quantisation scheme keeps them in full precision, as routing decisions are the most sensitive numbers of the block.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.models.llama import LlamaDecoderLayer, LlamaMLP
from folio.models.model_config import ModelConfig, MoEConfig
from folio.models.weight_loader import uninitialized


class Gate(nn.Module):
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


class Experts(nn.ModuleList):
    """The routed experts of one layer, each a LlamaMLP. runs[e] counts expert e's forwards, each one read of its
    weights: the step profile (folio.bench.step_profile) reports them per step."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__(LlamaMLP(cfg, moe.intermediate_size) for _ in range(moe.num_experts))
        self.runs = [0] * moe.num_experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        top_k = experts.shape[1]
        order = torch.argsort(experts.flatten(), stable=True)  # (token, slot) choices grouped by expert
        counts = torch.bincount(experts.flatten(), minlength=len(self)).tolist()
        tokens, slot_weights = order // top_k, weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                y = self[expert](x.index_select(0, rows)) * slot_weights[start:start + count]
                out.index_add_(0, rows, y.to(out.dtype))
                self.runs[expert] += 1
            start += count
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, float_weights: bool) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = TopKRouter(cfg, float_weights)
        self.experts = Experts(cfg, moe)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Gate(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose feed-forward is a SparseMoeBlock where the config makes the layer sparse.
    float_weights: whether routing weights stay float32 (Mixtral) or take the activations' dtype (Qwen)."""

    float_weights = False

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but its config has no num_experts "
                             "(or num_local_experts)")
        return SparseMoeBlock(cfg, self.float_weights) if cfg.moe.is_sparse(layer_idx) else LlamaMLP(cfg)
