"""DeepSeek's routers (DeepSeek V2 and V3, GLM-4.5 MoE): each token's top-k experts chosen
within its best groups of experts, with weights that need not sum to one.

Against the softmax-top-k router of Mixtral and Qwen (folio.models.moe.TopKRouter):

  * scores: a softmax over the router logits (DeepSeek V2's `scoring_func` "softmax") or each logit's sigmoid
    (V3's "sigmoid");
  * V3's `topk_method` "noaux_tc": a learned per-expert bias (`e_score_correction_bias`, float32) is added to the
    scores to *choose* the experts, while the weights are the unbiased scores of the chosen ones (auxiliary-loss-free
    load balancing);
  * groups: the experts are cut into `n_group` equal groups, each token keeps its `topk_group` best groups and picks
    its experts among theirs: V2's "group_limited_greedy" ranks a group by its best score, V3's "noaux_tc" by the sum
    of its two best (biased) scores; "greedy" has no groups;
  * the weights are renormalised to sum 1 where norm_topk_prob says so, then multiplied by routed_scaling_factor.

The router runs in float32 (Transformers keeps its weight in float32 and casts the activations up) and returns
float32 weights, which the experts multiply their outputs by.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from folio.models.hot_path import HotPathModule
from folio.models.weight_loader import uninitialized

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class GroupedTopKRouter(HotPathModule):
    def __init__(self, hidden_size: int, hf: dict[str, Any], num_experts: int, top_k: int) -> None:
        """hf: the config.json dict, with its architecture's defaults (folio.models.model_config.HF_DEFAULTS: V2's
        router is a greedy softmax, V3's and GLM-4.5's noaux_tc on sigmoids, where config.json leaves them out)."""
        super().__init__()
        self.topk_method = hf.get("topk_method") or "greedy"
        self.scoring = hf.get("scoring_func") or "softmax"
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r} (supported: {', '.join(TOPK_METHODS)})")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring_func {self.scoring!r} (supported: {', '.join(SCORING_FUNCS)})")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups = int(hf.get("n_group") or 1) if self.topk_method != "greedy" else 1
        self.topk_groups = int(hf.get("topk_group") or 1) if self.topk_method != "greedy" else 1
        if num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the {num_experts} experts and topk_group "
                             f"({self.topk_groups}) lie between 1 and n_group")
        if self.topk_groups * (num_experts // self.num_groups) < top_k:
            raise ValueError(f"topk_group ({self.topk_groups}) groups hold fewer experts than num_experts_per_tok "
                             f"({top_k})")
        self.normalize = bool(hf.get("norm_topk_prob", False))
        self.scaling = float(hf.get("routed_scaling_factor") or 1.0)
        self.weight = uninitialized(num_experts, hidden_size)
        self.e_score_correction_bias = (uninitialized(num_experts, dtype=torch.float32)
                                        if self.topk_method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32, experts int64), both [T, top_k]."""
        logits = nn.functional.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            rank = (grouped.max(dim=-1).values if self.topk_method == "group_limited_greedy"
                    else grouped.topk(2, dim=-1).values.sum(dim=-1))
            kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(self.topk_groups, dim=-1).indices,
                                                                      True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling if self.scaling != 1.0 else weights, experts
