"""Prefill attention as tiled matrix products from the paged cache: the long-query path for bf16 and 8-bit caches,
in float32 products on CPUs without AVX-512 and in bf16 products on CPUs with AVX512-BF16 or AMX.

The paged kernel (folio/csrc/cpu_paged_attention.cpp) attends one query row and one key at a time; a prompt or a
prefill chunk is a matrix product. folio/csrc/cpu_flash_prefill.cpp runs it FlashAttention style in PyTorch's
`at::native::cpublas::brgemm`: per (request, kv head, tile of query tokens, the query heads of the kv head stacked)
S = Q K^T, scale, soft-cap, causal and window masks, an online softmax in float32, then O += P V, reading K and V
from the paged cache (packed once per request and kv head). Every layer kind is handled: causal, sliding windows,
soft-capped scores, attention sinks (each row's sum of probabilities gains exp(sink - its max) at the end). The
products come in two kinds:

- float32 (`bf16_products=False`): K, V and q widened to float32 (an 8-bit row, folio.attention.kv_quant, as its
  codes times its scale, so a row of an 8-bit cache and a bf16 one of the same values pack to the same floats).
  Measured with benchmarks/attention_bench.py --long-queries on an AVX2 EPYC, 2 threads, one Qwen2-0.5B layer:
  13.6x the kernel's scalar loop of then on an 1852-token prompt (3242 ms to 238 ms), 12.8x on a 256-token chunk
  after 1000 of context, 5.6x on a 64-token prompt, 2.5x on a step of a 16-token chunk and 15 decodes; bf16
  products through brgemm's fallback GEMM were no faster there, nor was PyTorch's flash attention
  (folio.attention.sdpa_prefill: 153 against 110 ms on the 1852-token prompt, 6.7 against 3.7 ms on a 256-token one).
- bf16 (`bf16_products=True`, bf16 q; bf16 or 8-bit caches): K and V packed as they are, in the pairs oneDNN's
  micro-kernel reads (AMX tiles where the CPU has them, AVX512-BF16 elsewhere), the probabilities rounded to bf16
  before P V as the paged kernel and PyTorch's flash attention round them, their sum taken of the rounded values.
  An 8-bit cache's codes go in as bf16 (exactly), its scales apart: K's on the scores, V's on the probabilities
  before they are rounded. Zen 4 (2 threads, `python benchmarks/attention_bench.py --long-queries`, one layer,
  bf16 cache): against the kernel's AVX-512 loop, 1.67x on an 1852-token Qwen2-0.5B prompt (33.7 -> 20.1 ms), 1.50x
  on seven 256-token prompts, 1.56x on a 256-token chunk after 1000; from 128 query tokens every shape measured
  gains (prompts of 128: 1.01-1.19x, of 256: 1.32-1.47x over Qwen2-0.5B's, SmolLM2's and Qwen3-0.6B's heads),
  below that the kernel wins (64: 0.68-0.87x); 2.7-6.3x faster than PyTorch's flash attention (sdpa_prefill) on
  the same cases. 8-bit caches there take the bf16 caches' rule, unmeasured. On AMX (2 cores of an Emerald Rapids
  Xeon, same command): bf16 cache 3.9x the kernel on the 1852-token Qwen2-0.5B prompt (57.5 -> 14.8 ms), 3.2x on
  seven 256-token prompts, 3.7x on the chunk, Qwen3-0.6B 4.5x / 3.0x / 3.7x; against sdpa_prefill (oneDNN's
  GEMMs, the path AMX machines took before; `--versus-sdpa`) 1.09-1.63x; int8 cache 3.4x / 3.0x / 3.3x (fp8
  3.3x / 2.6x / 3.1x). Each tile's K and V are packed 16 keys at a time in AVX-512 registers (K's pairs of dims
  transposed as 16 x 16 words, V's keys interleaved by pairs; an 8-bit row's codes widened 16 at a time) where
  head_dim is a multiple of 32, a scalar loop otherwise; on AMX that took the short chunks after long contexts
  1.1-1.9x (Qwen3-0.6B, 16 tokens after 1000 keys: 0.89x the kernel before, 1.70x after; int8 0.92x -> 1.55x).
  `--query-lens 16,32,64` then found where the path starts to win on AMX: prompts of 32 tokens tie (bf16
  1.03-1.32x, 8-bit 1.00-1.05x), of 64 win (bf16 1.82-2.00x, 8-bit 1.41-1.58x); chunks of 16 after 1000 keys win
  (bf16 1.70-2.66x, 8-bit 1.55-2.49x), prompts of 16 do not (0.89-1.10x): hence rules on (query, key) pairs too.
  With stop 55's softmax (`--query-lens 8,16,32`, Qwen2-0.5B, Qwen3-0.6B, SmolLM2, Llama-3-8B's shape) prompts of 16
  tokens win as well (bf16 1.34-1.71x, int8 and fp8 1.15-1.66x) and chunks of 8 after 1000 keys (1.12-2.49x),
  prompts of 8 do not (0.81-1.27x): the AMX rules now take prompts from 16 tokens and chunks from 8.

The kernel is built when a cache first needs it (about 60 s on two cores, once per machine: CPUBlas.h brings in
oneDNN's headers).
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.attention.backend import AttentionParams
from folio.attention.long_query import LongQueryPath
from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_flash_prefill", CSRC / "cpu_flash_prefill.cpp", what="CPU prefill attention kernel",
                   fallback="long queries on bf16 and 8-bit caches stay on the paged attention kernel")
# (min query tokens, min (query token, key) pairs) of a request sent here, measured above: float32 products
# against the kernel's AVX2 loop; bf16 ones against its AVX-512 loop on Zen 4 and on AMX, for bf16 and 8-bit caches
FLOAT32_PRODUCTS = (4, 256)
BF16_PRODUCTS = (128, 0)
BF16_PRODUCTS_AMX = (8, 1 << 8)  # prompts from 16 tokens, chunks from 8 after 24 keys
EIGHT_BIT_PRODUCTS = BF16_PRODUCTS
EIGHT_BIT_PRODUCTS_AMX = BF16_PRODUCTS_AMX


class FlashPrefill(LongQueryPath):
    def __init__(self, min_query_len: int = FLOAT32_PRODUCTS[0], min_query_key_pairs: int = FLOAT32_PRODUCTS[1],
                 bf16_products: bool = False) -> None:
        self.ext = KERNEL.load()
        if self.ext is None:
            raise RuntimeError(f"prefill attention kernel unavailable: {KERNEL.error}")
        if bf16_products and not self.ext.has_bf16_products():
            raise RuntimeError("bf16 products need AVX512-BF16 and oneDNN's micro-kernel")
        self.min_query_len = min_query_len
        self.min_query_key_pairs = min_query_key_pairs
        self.bf16_products = bf16_products

    def supports(self, params: AttentionParams, q: torch.Tensor) -> bool:
        # bf16 operands: bf16 q, in pairs along head_dim (a float32 model's q with an 8-bit cache stays on the kernel);
        # a positive scale (the kernel's softmax scales the scores' max: no model here has another)
        if params.scale_for(q.shape[-1]) <= 0:
            return False
        return not self.bf16_products or (q.dtype == torch.bfloat16 and q.shape[-1] % 2 == 0)

    def attend(self, out, q, k_cache, v_cache, reqs, block_tables, scale, params) -> None:
        self.ext.flash_prefill(out, q, k_cache, v_cache, reqs, block_tables, scale, params.sliding_window or 0,
                               params.logit_softcap or 0.0, params.sinks, self.bf16_products)


def if_built() -> Optional[FlashPrefill]:
    """The float32-products path, or None (the paged kernel keeps the long queries) where its kernel does not
    build."""
    return FlashPrefill() if KERNEL.load() is not None else None


def bf16_products_if_built(min_query_len: int, min_query_key_pairs: int) -> Optional[FlashPrefill]:
    """The bf16-products path, or None (the paged kernel keeps the long queries) where the kernel does not build or
    this CPU has no AVX512-BF16."""
    ext = KERNEL.load()
    if ext is None or not ext.has_bf16_products():
        return None
    return FlashPrefill(min_query_len, min_query_key_pairs, bf16_products=True)
