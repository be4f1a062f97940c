"""Prefill attention through PyTorch's CPU flash attention: the long-query path for float32 caches on CPUs without
AVX-512.

`F.scaled_dot_product_attention` on CPU runs FlashAttention tiles (an online softmax in float32) whose two
products go to PyTorch's CPU GEMMs: MKL for float32, oneDNN for bf16, which uses AMX tiles where the CPU has
them, the matrix unit the paged kernel's dot-product loops never reach. A request's context is gathered from its
blocks once per layer (from its first query's window on), then:
- a whole prompt without a window takes one call with `is_causal` (the kernel skips the tiles above the diagonal);
- a chunk after context, or a windowed layer, takes calls over tiles of queries, each over the keys its rows see
  (from its first row's window) with a boolean mask (causal from the chunk's position, and the window); a tile's
  mask stays within MASK_ELEMENTS, whatever the context.
Grouped-query heads read their kv head through `enable_gqa` (no copy of K/V per query head). Soft-capped scores
(Gemma 2) and attention sinks (GPT-OSS) are not expressible there: such layers keep their long queries on the paged
kernel.

Measured on an AVX2 EPYC (2 threads, Qwen2-0.5B shapes, float32, one layer). Against the paged kernel's scalar
float32 loop of then (benchmarks/attention_bench.py --long-queries --dtype float32): an 1852-token prompt 780 -> 92
ms, a 256-token chunk after 1000 of context 140 -> 15 ms. Side by side with the blocked-GEMM path it replaced: 233 ->
133 ms on the 1852-token prompt, 11.8 -> 6.2 ms on a 256-token one. Since the kernel's AVX2 vector loop (Zen 3, the
kernel alone against this path): an 1852-token prompt 125 against 83 ms, a 256-token chunk after 1000 21.3 against
16.1, a 128-token one 10.2 against 8.5, a 64-token one 6.0 against 5.0 (SmolLM2's shapes, 3 query heads per kv
head: 3.7 against 3.9); but prompts of 512 tokens 9.2 against 10.4, of 256 2.6 against 3.5, and a 16-token chunk
with 15 decodes 2.3 against 3.0. The rule below sends a request here from 64 query tokens and 2^17 (query, key)
pairs: the 128-token chunk comes here, the 64-token one and prompts up to 362 tokens stay, a 512-token prompt
comes here though 1.13x slower (its pairs are the chunk's, in a triangle). bf16 caches on AMX machines came here
too, 2.75-2.88x the kernel's AVX-512 loop on long queries there (an Emerald Rapids Xeon, 2 cores), until
folio.attention.flash_prefill's bf16 products, 2.7-6.3x faster than this path on Zen 4, took them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from folio.attention.backend import AttentionParams
from folio.attention.long_query import LongQueryPath

# a tile of queries with an explicit mask has at most this many (query, key) mask entries (the mask is widened to
# the query's dtype inside SDPA: 16 MiB in float32)
MASK_ELEMENTS = 1 << 22
MIN_TILE_QUERIES = 16
# (min query tokens, min (query token, key) pairs) of a request sent here: measured above for float32 caches
# against the kernel's AVX2 loop
FLOAT32_WITHOUT_AVX512 = (64, 1 << 17)


class SdpaPrefill(LongQueryPath):
    def __init__(self, min_query_len: int, min_query_key_pairs: int) -> None:
        self.min_query_len = min_query_len
        self.min_query_key_pairs = min_query_key_pairs

    def supports(self, params: AttentionParams, q: torch.Tensor) -> bool:
        return params.logit_softcap is None and params.sinks is None

    def attend(self, out, q, k_cache, v_cache, reqs, block_tables, scale, params) -> None:
        for row, (first_token, query_len, context_len) in enumerate(reqs.tolist()):
            attend(out, q, k_cache, v_cache, block_tables[row], first_token, query_len, context_len, scale,
                   params.sliding_window)


def attend(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           first_token: int, query_len: int, context_len: int, scale: float, window: Optional[int]) -> None:
    """Write into out the attention of one request's query_len rows q[first_token:] (the last query_len positions
    of its context_len tokens); k_cache/v_cache are [blocks, block_size, Hkv, D]."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_pos = context_len - query_len
    first_key = max(0, first_pos - window + 1) if window else 0  # blocks before it may hold anything
    first_block = first_key // block_size
    ids = table[first_block:-(-context_len // block_size)].long()
    skip = first_key - first_block * block_size

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, keys, D]
        return cache[ids].flatten(0, 1)[skip:context_len - first_block * block_size].transpose(0, 1)[None]

    keys, values = gathered(k_cache), gathered(v_cache)
    queries = q[first_token:first_token + query_len].transpose(0, 1)[None]  # [1, Hq, query_len, D]
    gqa = q.shape[1] != num_kv_heads
    if first_pos == 0 and not window:
        result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        out[first_token:first_token + query_len] = result[0].transpose(0, 1)
        return
    tile = max(MIN_TILE_QUERIES, MASK_ELEMENTS // keys.shape[2])
    for start in range(0, query_len, tile):
        stop = min(query_len, start + tile)
        # the keys the tile's rows see: from its first row's window (or the context's start) to its last row
        lo = max(first_key, first_pos + start - window + 1) if window else 0
        hi = first_pos + stop
        positions = torch.arange(first_pos + start, hi)[:, None]
        key_positions = torch.arange(lo, hi)[None, :]
        mask = key_positions <= positions
        if window:
            mask &= key_positions > positions - window
        result = F.scaled_dot_product_attention(queries[:, :, start:stop], keys[:, :, lo - first_key:hi - first_key],
                                                values[:, :, lo - first_key:hi - first_key], attn_mask=mask,
                                                scale=scale, enable_gqa=gqa)
        out[first_token + start:first_token + stop] = result[0].transpose(0, 1)
