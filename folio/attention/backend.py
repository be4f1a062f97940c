"""The attention backend interface: the one seam where faster kernels replace the reference implementation.

A backend owns three things: the layout of the paged KV cache it reads (`kv_cache_shape`: the model runner
allocates what it declares), turning a step's batch layout into whatever metadata it needs (once per step,
shared by every layer), and computing attention for one layer from the flattened batch while writing the
new K/V into the paged cache. A new backend is a subclass, offered by a platform (folio.platforms).

The CPU backends' cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
token t of a request lives at slot block_table[t // block_size] * block_size + t % block_size.

How a layer attends beyond plain causal softmax(q.k / sqrt(head_dim)) is its `AttentionParams`: the softmax
scale, a sliding window (Mistral, Gemma 2 and 3), tanh soft-capping of the scores (Gemma 2), attention sinks
(GPT-OSS: a learned logit per query head that joins every softmax's denominator and adds no value, so a query may
attend to "nothing"; an online softmax adds exp(sink - m) to its sum once, at the end). A layer with a
sliding window never reads keys outside it: the block table entries of blocks that lie wholly before the
window of the step's first query are unspecified (the KV cache manager frees those blocks).

KV cache groups (models with sliding-window layers, folio.worker.kv_cache): the layers are grouped by their
window, each group has block tables of its own, and layers of different groups share cache tensors (a block
id holds different tokens in each group). A layer's cache is then a `LayerKVCache` naming its group, and the
step has metadata per group, built from that group's layout; the caller (folio.models.llama.StepContext) hands
each layer's forward its group's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class BatchLayout:
    """The flattened batch of one step, as the model runner built it (no padding between requests)."""

    query_lens: np.ndarray  # [B] int64: tokens each request computes this step
    seq_lens: np.ndarray  # [B] int64: each request's context length once this step's tokens are in
    # [B, max blocks] int32: request i's block ids in its first ceil(seq_lens[i] / block_size) columns;
    # the columns after those are unspecified
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    block_size: int

    @classmethod
    def from_lists(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int) -> "BatchLayout":
        """A layout from per-request lists (tests, benchmarks): slots follow from the tables."""
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        slots = []
        for i, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
        return cls(np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64), tables,
                   torch.tensor(slots, dtype=torch.int64), block_size)


@dataclass(frozen=True)
class AttentionParams:
    """How one layer attends. A query at position p sees the keys at positions t <= p, and with a sliding
    window W only those with p - W < t <= p (W keys, itself included: Transformers' sliding_window)."""

    scale: Optional[float] = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: Optional[int] = None  # W, or None: every earlier key
    logit_softcap: Optional[float] = None  # scores s -> cap * tanh(s / cap) (after the scale, before softmax)
    # float32 [num query heads] (of the rank), or None: head h's softmax is over its scores and sinks[h], whose
    # probability multiplies no value. The layer's own parameter, read at each call (loading fills it in place);
    # compared by nothing (two layers' params are never told apart by their sinks' values)
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        if self.sinks is not None and (self.sinks.dim() != 1 or self.sinks.dtype != torch.float32):
            raise ValueError(f"sinks must be a float32 vector (one per query head), got {self.sinks.dtype} of shape "
                             f"{tuple(self.sinks.shape)}")

    def scale_for(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else self.scale


FULL_ATTENTION = AttentionParams()


class LayerKVCache(tuple):
    """One layer's (K cache, V cache), unpacking as that pair, and the KV cache group whose block tables
    address it."""

    group: int

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, group: int = 0) -> "LayerKVCache":
        self = super().__new__(cls, (k_cache, v_cache))
        self.group = group
        return self


class AttentionBackend(ABC):
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K cache (and of its V cache) that this backend reads and writes; the default is
        the token-major layout above, which slot mapping addresses as [num_blocks * block_size, heads, dim]."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Precompute per-step metadata (index tensors, masks) used by every layer's forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any,
                params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> attention output [T, Hq, D]; stores k and v in kv_cache."""
