"""KVCacheSpec: what the paged KV cache of a model holds, so its size per block and its tensors follow from
one description and from the attention backend's layout.

The engine divides the platform's KV budget by `bytes_per_block` to get the number of blocks; the model
runner then allocates, per layer, a K and a V tensor of the shape the backend declares. An 8-bit cache
(`cache_dtype` int8 or fp8, folio.attention.kv_quant) stores each head's row as bytes with its scale, so a
block takes about half (of bf16) or a quarter (of float32) the bytes, and the same budget holds that many
more tokens. The cache is the budget's address space; memory becomes resident as blocks are written, and the
block pool hands out low block ids first, so a small workload touches few pages of it.

Sliding-window layers (Gemma 2 and 3, Mistral) need only the keys of their window, so their old blocks can be
freed while the request runs (vLLM's hybrid KV cache). The layers are grouped by window into KV cache
groups of equal size N: each group has block tables of its own (the KV cache manager frees a sliding group's
blocks that fall wholly out of its window), and a block of the shared pool holds N layers' K/V for
block_size tokens. So N pairs of tensors are allocated, and layer j of every group uses pair j: a block id
means one group's tokens in all of them. N is the smallest number of layers of one window (or the largest,
when all are within 25% of it, as vLLM chooses), so a group type whose layer count is not a multiple of N
leaves the last group's spare tensor slots unused. Gemma 3 (five local layers to one global): one full
group and five local ones of the same size, and a long request holds about one sixth of the blocks a
full-attention cache would, plus its windows. A model without sliding layers has one group of all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import torch

from folio.attention.backend import AttentionBackend, LayerKVCache
from folio.attention.kv_quant import KV_QUANTIZATIONS
from folio.memory import zeros_on_demand
from folio.models.model_config import ModelConfig
from folio.utils.math_utils import cdiv

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K cache, V cache)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose K/V share block tables: one sliding window (None: full attention)."""

    window: Optional[int]
    layers: tuple[int, ...]

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens holds in this group at any step, if no step computes more
        than max_chunk tokens: all of them, or a sliding group's window before a chunk and the chunk."""
        full = cdiv(num_tokens, block_size)
        if self.window is None:
            return full
        return min(full, cdiv(self.window - 1 + min(max_chunk, num_tokens), block_size) + 1)


def group_layers(windows: Sequence[Optional[int]], num_layers: int) -> tuple[tuple[KVCacheGroup, ...], int]:
    """(groups, N): the layers grouped by sliding window into groups of at most N layers, full attention first."""
    by_window: dict[Optional[int], list[int]] = {}
    for i in range(num_layers):
        by_window.setdefault(windows[i] if windows else None, []).append(i)
    counts = [len(layers) for layers in by_window.values()]
    size = min(counts) if max(counts) >= 1.25 * min(counts) else max(counts)
    groups = []
    for window in sorted(by_window, key=lambda w: -1 if w is None else w):
        layers = by_window[window]
        groups += [KVCacheGroup(window, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return tuple(groups), size


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what attention computes in, and the cache's unless cache_dtype says 8 bits
    cache_dtype: str = "auto"  # auto | int8 | fp8
    # per layer, the sliding window its attention uses (None: full); () for none. Sliding layers form KV
    # cache groups of their own, whose blocks out of the window are freed.
    layer_windows: tuple[Optional[int], ...] = ()
    # a layer's values are its keys (multi-head latent attention's one row a token, folio.models.mla): one tensor
    # serves as both, and a block takes half the bytes
    values_are_keys: bool = False

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto",
                  layer_windows: Sequence[Optional[int]] = ()) -> "KVCacheSpec":
        """layer_windows: per layer of the model, or (); the cache's layers are the model's kv_cache_layers (a
        hybrid model's recurrent layers keep no K/V)."""
        layers = cfg.kv_cache_layers
        windows = tuple(layer_windows[i] for i in layers) if any(w is not None for w in layer_windows) else ()
        return cls(len(layers), cfg.num_key_value_heads, cfg.head_dim, block_size, dtype, cache_dtype, windows,
                   cfg.values_are_keys)

    @cached_property
    def _grouping(self) -> tuple[tuple[KVCacheGroup, ...], int]:
        return group_layers(self.layer_windows, self.num_layers)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return self._grouping[0]

    @property
    def full_attention_group(self) -> Optional[int]:
        """The first group of full-attention layers (groups are sorted so: 0), or None when every layer slides.
        A draft model reads its block tables: they hold the whole context for as long as the request runs."""
        return 0 if self.groups[0].window is None else None

    @property
    def layers_per_block(self) -> int:
        """N: the layers whose K/V one block holds (every layer, without sliding groups)."""
        return self._grouping[1]

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of num_tokens tokens holds, over every group."""
        return sum(g.max_blocks(num_tokens, self.block_size, max_chunk) for g in self.groups)

    def full_attention_blocks(self, num_tokens: int) -> float:
        """What a cache without sliding groups would hold for num_tokens, in blocks of this spec's size."""
        return cdiv(num_tokens, self.block_size) * self.num_layers / self.layers_per_block

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
        return (self._tensors_per_layer * self.num_layers * self.num_kv_heads * self.row_size
                * self.storage_dtype.itemsize)

    @property
    def _tensors_per_layer(self) -> int:
        return 1 if self.values_are_keys else 2

    def layer_shape(self, backend: AttentionBackend, num_blocks: int) -> tuple[int, ...]:
        return backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.row_size)

    def bytes_per_block(self, backend: AttentionBackend) -> int:
        """Bytes one block takes in the backend's layout, K and V of its N layers (every layer, without
        sliding groups)."""
        return (self._tensors_per_layer * self.layers_per_block * math.prod(self.layer_shape(backend, 1))
                * self.storage_dtype.itemsize)

    def allocate(self, backend: AttentionBackend, num_blocks: int, device: torch.device) -> KVCaches:
        """Per layer, its (K, V) cache: N pairs of tensors, layer j of each group on pair j. The tensors are
        zeros: padded reads of never-written slots must be finite (masked, but NaN * 0 is NaN). On the CPU the
        zeros cost no resident memory until a block is written (folio.memory.zeros_on_demand), so the budget is
        address space and a small workload pays for few blocks; elsewhere they are plain zeros in device
        memory. Where values are keys, a layer's pair is one tensor twice."""
        shape, dtype = self.layer_shape(backend, num_blocks), self.storage_dtype

        def zeros() -> torch.Tensor:
            if device.type == "cpu":
                return zeros_on_demand(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        pairs = []
        for _ in range(self.layers_per_block):
            keys = zeros()
            pairs.append((keys, keys) if self.values_are_keys else (keys, zeros()))
        if len(self.groups) == 1:
            return pairs
        caches: list = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                caches[layer] = LayerKVCache(*pairs[j], group=g)
        return caches
