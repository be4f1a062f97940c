"""KVCacheSpec: what the paged KV cache of a model holds, so its size per block and its tensors follow from
one description and from the attention backend's layout.

The engine divides the platform's KV budget by `bytes_per_block` to get the number of blocks; the model
runner then allocates, per layer, a K and a V tensor of the shape the backend declares. An 8-bit cache
(`cache_dtype` int8 or fp8, folio.attention.kv_quant) stores each head's row as bytes with its scale, so a
block takes about half (of bf16) or a quarter (of float32) the bytes, and the same budget holds that many
more tokens. The cache is the budget's address space; memory becomes resident as blocks are written, and the
block pool hands out low block ids first, so a small workload touches few pages of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from folio.attention.backend import AttentionBackend
from folio.attention.kv_quant import KV_QUANTIZATIONS
from folio.memory import zeros_on_demand
from folio.models.model_config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K cache, V cache)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what attention computes in, and the cache's unless cache_dtype says 8 bits
    cache_dtype: str = "auto"  # auto | int8 | fp8

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  cache_dtype: str = "auto") -> "KVCacheSpec":
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype, cache_dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype if self.cache_dtype == "auto" else KV_QUANTIZATIONS[self.cache_dtype].storage_dtype

    @property
    def row_size(self) -> int:
        """Elements of one (token, kv head) row: head_dim, plus its scale's bytes in an 8-bit cache."""
        if self.cache_dtype == "auto":
            return self.head_dim
        return KV_QUANTIZATIONS[self.cache_dtype].row_size(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token's KV takes across all layers (the data, whatever the layout)."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_size * self.storage_dtype.itemsize

    def layer_shape(self, backend: AttentionBackend, num_blocks: int) -> tuple[int, ...]:
        return backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.row_size)

    def bytes_per_block(self, backend: AttentionBackend) -> int:
        """Bytes one block takes in the backend's layout, K and V of every layer."""
        return 2 * self.num_layers * math.prod(self.layer_shape(backend, 1)) * self.storage_dtype.itemsize

    def allocate(self, backend: AttentionBackend, num_blocks: int, device: torch.device) -> KVCaches:
        """Zeroed K and V tensors per layer: padded reads of never-written slots must be finite (masked, but
        NaN * 0 is NaN). On the CPU the zeros cost no resident memory until a block is written
        (folio.memory.zeros_on_demand), so the budget is address space and a small workload pays for few
        blocks; elsewhere they are plain zeros in device memory."""
        shape, dtype = self.layer_shape(backend, num_blocks), self.storage_dtype
        if device.type == "cpu":
            return [(zeros_on_demand(shape, dtype), zeros_on_demand(shape, dtype)) for _ in range(self.num_layers)]
        return [tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
                for _ in range(self.num_layers)]
