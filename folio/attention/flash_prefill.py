"""Prefill attention for bf16 and 8-bit caches as tiled matrix products: the long-query path for those caches on CPUs
without AVX-512.

The paged kernel (folio/csrc/cpu_paged_attention.cpp) attends one query row and one key at a time, and without
AVX-512 its bf16 loop is scalar; a prompt or a prefill chunk is a matrix product. folio/csrc/cpu_flash_prefill.cpp
runs it FlashAttention style in PyTorch's `at::native::cpublas::brgemm` with float32 operands: per (request,
kv head, tile of query tokens, the query heads of the kv head stacked) S = Q K^T, scale, soft-cap, causal and
window masks, an online softmax in float32, then O += P V, reading K and V from the paged cache (widened and
packed once per request and kv head; an 8-bit row, folio.attention.kv_quant, as its codes times its scale in
float32, so a row of an 8-bit cache and a bf16 one of the same values pack to the same floats; q and the output
are bf16 or float32). Every layer kind is handled: causal, sliding windows, soft-capped scores.

Measured with benchmarks/attention_bench.py --long-queries on an AVX2 EPYC, 2 threads, one Qwen2-0.5B layer:
13.6x on an 1852-token prompt (3242 ms to 238 ms), 12.8x on a 256-token chunk after 1000 of context, 5.6x on a
64-token prompt, 2.5x on a step of a 16-token chunk and 15 decodes; bf16 products through brgemm's fallback
GEMM were no faster there, nor was PyTorch's flash attention (folio.attention.sdpa_prefill: 153 against 110 ms
on the 1852-token prompt, 6.7 against 3.7 ms on a 256-token one). CPUs with AVX-512 keep the paged kernel's
vector bf16 code, and AMX ones send long bf16 queries to sdpa_prefill (oneDNN's GEMMs on AMX tiles).

The kernel is built when a bf16 or 8-bit cache first needs it (about 60 s on two cores, once per machine: CPUBlas.h
brings in oneDNN's headers).
"""

from __future__ import annotations

from typing import Optional

from folio.attention.backend import AttentionParams
from folio.attention.long_query import LongQueryPath
from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_flash_prefill", CSRC / "cpu_flash_prefill.cpp", what="CPU prefill attention kernel",
                   fallback="long queries on bf16 and 8-bit caches stay on the paged attention kernel")
# measured above: from 4 query tokens and 256 (query token, key) pairs
MIN_QUERY_LEN, MIN_QUERY_KEY_PAIRS = 4, 256


class FlashPrefill(LongQueryPath):
    def __init__(self, min_query_len: int = MIN_QUERY_LEN, min_query_key_pairs: int = MIN_QUERY_KEY_PAIRS) -> None:
        self.ext = KERNEL.load()
        if self.ext is None:
            raise RuntimeError(f"bf16 prefill attention kernel unavailable: {KERNEL.error}")
        self.min_query_len = min_query_len
        self.min_query_key_pairs = min_query_key_pairs

    def supports(self, params: AttentionParams, head_dim: int) -> bool:
        return True

    def attend(self, out, q, k_cache, v_cache, reqs, block_tables, scale, params) -> None:
        self.ext.flash_prefill(out, q, k_cache, v_cache, reqs, block_tables, scale, params.sliding_window or 0,
                               params.logit_softcap or 0.0)


def if_built() -> Optional[FlashPrefill]:
    """The path, or None (the paged kernel keeps the long queries) where its kernel does not build."""
    return FlashPrefill() if KERNEL.load() is not None else None
