"""The attention backend interface: the one seam where faster kernels replace the reference implementation.

A backend owns two things: turning a step's batch layout into whatever metadata it needs (once per step,
shared by every layer), and computing attention for one layer from the flattened batch while writing the
new K/V into the paged cache.

The paged cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
token t of a request lives at slot block_table[t // block_size] * block_size + t % block_size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class BatchLayout:
    """The flattened batch of one step, as the model runner built it (no padding between requests)."""

    query_lens: list[int]  # tokens each request computes this step
    seq_lens: list[int]  # each request's context length once this step's tokens are in
    block_tables: list[list[int]]  # each request's block ids
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_size: int


class AttentionBackend(ABC):
    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Precompute per-step metadata (index tensors, masks) used by every layer's forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> attention output [T, Hq, D]; stores k and v in kv_cache."""
