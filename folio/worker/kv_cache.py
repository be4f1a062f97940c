"""KVCacheSpec: what the paged KV cache of a model holds, so its size per block and its tensors follow from
one description and from the attention backend's layout.

The engine divides the platform's KV budget by `bytes_per_block` to get the number of blocks; the model
runner then allocates, per layer, a K and a V tensor of the shape the backend declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from folio.attention.backend import AttentionBackend
from folio.models.model_config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K cache, V cache)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token's KV takes across all layers (the data, whatever the layout)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_shape(self, backend: AttentionBackend, num_blocks: int) -> tuple[int, ...]:
        return backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, backend: AttentionBackend) -> int:
        """Bytes one block takes in the backend's layout, K and V of every layer."""
        return 2 * self.num_layers * math.prod(self.layer_shape(backend, 1)) * self.dtype.itemsize

    def allocate(self, backend: AttentionBackend, num_blocks: int, device: torch.device) -> KVCaches:
        shape = self.layer_shape(backend, num_blocks)
        # zeros, not empty: padded reads of never-written slots must be finite (masked, but NaN * 0 is NaN)
        return [tuple(torch.zeros(shape, dtype=self.dtype, device=device) for _ in "kv")
                for _ in range(self.num_layers)]
