"""Prefill attention as blocked matrix products, for CPUs where the paged kernel has no vector code.

Without AVX-512 the C++ paged kernel (folio/csrc/cpu_paged_attention.cpp) attends with a scalar loop, one
query row and one key at a time; a long prompt's attention is a matrix product, and MKL's GEMM runs it several
times faster (measured on an AVX2 EPYC: one Qwen2-0.5B layer of an 1852-token prefill, 2.0 s scalar against
0.5 s in GEMMs). So a request with a long query in the step (a prompt or a prefill chunk) is attended here, from
the cache the kernel has just written: its context's K and V are gathered from its blocks once per layer,
then each tile of query rows (every head of a kv-head group stacked, so K and V are read once for the group)
takes one batched GEMM for the scores, the causal mask on the tile's own diagonal keys, a softmax and one
GEMM for the output. Scores and softmax are float32 (float32 caches only: bf16 caches have
folio.attention.flash_prefill, 8-bit caches stay on the kernel). A tile's rows are sized so its score matrix
stays within SCORE_TILE_BYTES, whatever the context.
"""

from __future__ import annotations

import math

import torch

from folio.attention.backend import AttentionParams
from folio.attention.long_query import LongQueryPath
from folio.utils.math_utils import cdiv

# A request is attended here when it has at least this many query tokens and (query token, key) pairs. Measured
# on the AVX2 EPYC, Qwen2-0.5B shapes, one layer: 128 tokens of prompt 0.58x the kernel's speed (fixed costs),
# 256 tokens 1.6x, 64 tokens after 1000 of context 2.8x, 1852 tokens 3.8x.
MIN_QUERY_LEN = 32
MIN_QUERY_KEY_PAIRS = 1 << 15
SCORE_TILE_BYTES = 32 << 20
MAX_TILE_TOKENS = 256


def attend(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           first_token: int, query_len: int, context_len: int, scale: float) -> None:
    """Write the attention of one request's query_len query rows q[first_token:] (the last query_len
    positions of its context_len tokens, causal, scores times scale) into out; k_cache/v_cache are
    [blocks, block_size, Hkv, D]."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    ids = table[:cdiv(context_len, block_size)].long()
    keys = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1)  # [Hkv, ctx, D]
    values = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1)
    queries = q[first_token:first_token + query_len].reshape(query_len, num_kv_heads, group, head_dim)
    queries = queries.permute(1, 0, 2, 3)  # [Hkv, query_len, G, D]
    first_pos = context_len - query_len
    tile = max(1, min(MAX_TILE_TOKENS, SCORE_TILE_BYTES // (4 * num_kv_heads * group * context_len)))
    for start in range(0, query_len, tile):
        stop = min(query_len, start + tile)
        rows, visible = (stop - start) * group, first_pos + stop  # keys the tile's last query sees
        scores = torch.bmm(queries[:, start:stop].reshape(num_kv_heads, rows, head_dim),
                           keys[:, :visible].transpose(1, 2)).mul_(scale)  # [Hkv, rows, visible]
        positions = torch.arange(first_pos + start, first_pos + stop).repeat_interleave(group)
        diagonal = torch.arange(first_pos + start, visible)[None, :] > positions[:, None]
        scores[:, :, first_pos + start:].masked_fill_(diagonal, -math.inf)
        tile_out = torch.bmm(torch.softmax(scores, dim=-1), values[:, :visible])  # [Hkv, rows, D]
        out[first_token + start:first_token + stop] = tile_out.reshape(num_kv_heads, stop - start, group, head_dim) \
            .permute(1, 0, 2, 3).reshape(stop - start, num_kv_heads * group, head_dim)


class GemmPrefill(LongQueryPath):
    """The path for float32 caches: plain causal layers only (windows and soft-capping stay on the kernel)."""

    min_query_len = MIN_QUERY_LEN
    min_query_key_pairs = MIN_QUERY_KEY_PAIRS

    def supports(self, params: AttentionParams, head_dim: int) -> bool:
        return params.sliding_window is None and params.logit_softcap is None

    def attend(self, out, q, k_cache, v_cache, reqs, block_tables, scale, params) -> None:
        for row, (first_token, query_len, context_len) in enumerate(reqs.tolist()):
            attend(out, q, k_cache, v_cache, block_tables[row], first_token, query_len, context_len, scale)
