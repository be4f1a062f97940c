"""The seam where CPUPagedAttentionBackend hands requests with long queries to a matrix-product path.

A prompt or a prefill chunk attends as a matrix product, which a GEMM engine runs many times faster than the
paged kernel's one-row-at-a-time loops; a decode or a short chunk does not. A `LongQueryPath` attends, for one
cache dtype, the requests of a step whose query is long enough by its own measured rule, straight from the cache
the paged kernel has just written; the paged kernel attends the others. Implementations: folio.attention
.sdpa_prefill (PyTorch's CPU flash attention) and folio.attention.flash_prefill (brgemm tiles, float32 or bf16
products); which one a CPU uses for which cache dtype: folio.attention.cpu_paged.long_query_paths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from folio.attention.backend import AttentionParams


class LongQueryPath(ABC):
    # a request goes here with at least this many query tokens and (query token, key) pairs
    min_query_len: int
    min_query_key_pairs: int

    def is_long(self, query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """Which requests of a step this path attends (bool [B])."""
        return (query_lens >= self.min_query_len) & (query_lens * seq_lens >= self.min_query_key_pairs)

    @abstractmethod
    def supports(self, params: AttentionParams, q: torch.Tensor) -> bool:
        """Whether a layer attending as params, with queries q [T, Hq, D], may come here (else its long queries stay
        on the kernel)."""

    @abstractmethod
    def attend(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               reqs: torch.Tensor, block_tables: torch.Tensor, scale: float, params: AttentionParams) -> None:
        """Write into out [T, Hq, D] the attention of the requests in reqs (int32 [B, 3]: first token in the
        batch, query length, context length; the queries are the context's last positions), reading K and V
        from the caches [blocks, block_size, Hkv, D] through block_tables (int32 [B, max blocks])."""
