"""Prefill attention for bf16 caches as tiled matrix products: the long-query path for bf16 caches.

The paged kernel (folio/csrc/cpu_paged_attention.cpp) attends one query row and one key at a time; a prompt or
a prefill chunk is a matrix product. folio/csrc/cpu_flash_prefill.cpp runs it FlashAttention style in
PyTorch's `at::native::cpublas::brgemm` (float32 sums): per (request, kv head, tile of query tokens, the query
heads of the kv head stacked) S = Q K^T, scale, soft-cap, causal and window masks, an online softmax in float32,
then O += P V, reading K and V from the paged cache (packed once per request and kv head). Every layer kind
is handled: causal, sliding windows, soft-capped scores.

Where oneDNN finds AMX (`could_pack(kBFloat16)`), the products are bf16 on AMX tiles, K and V packed in
pairs (the VNNI layout AMX reads). Elsewhere brgemm falls back to a plain GEMM, and bf16 there is emulated: the
kernel then widens K, V and Q to float32 when it packs them and runs float32 products (`widen`), which measured
as fast or faster on an AVX2 EPYC (one thread, Qwen2-0.5B shapes: 64-token prompt 0.41 ms against 0.58 ms in
bf16 products; 1852-token prompt 146-330 ms against 129-338 ms on a loaded machine).

Which CPUs use it (`for_cpu`): AMX ones (the issue's target, where it replaces the AVX-512 paged kernel;
not measured there), and those without AVX-512, where the paged kernel's bf16 loop is scalar (measured with
benchmarks/attention_bench.py --long-queries, 2 threads, one layer: 13.6x on an 1852-token prompt, 3242 ms
to 238 ms; 12.8x on a 256-token chunk after 1000 of context; 5.6x on a 64-token prompt; and before the softmax
was vectorised, 6.6x on 4 tokens after 1000 of context, 1.6x on a 16-token prompt, 0.67x on an 8-token one).
CPUs with AVX-512 but no AMX keep the paged kernel's vector bf16 code.

The kernel is built when a bf16 cache first needs it (about 60 s on two cores, once per machine: CPUBlas.h
brings in oneDNN's headers).
"""

from __future__ import annotations

from typing import Optional

from folio.attention.backend import AttentionParams
from folio.attention.long_query import LongQueryPath
from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_flash_prefill", CSRC / "cpu_flash_prefill.cpp", what="CPU bf16 prefill attention kernel",
                   fallback="long bf16 queries stay on the paged attention kernel")
# Without AVX-512 (measured above): from 4 query tokens and 256 (query token, key) pairs. With AMX: the
# float32 GEMM path's rule (folio.attention.gemm_prefill), until measured there.
SCALAR_MIN_QUERY_LEN, SCALAR_MIN_QUERY_KEY_PAIRS = 4, 256
AMX_MIN_QUERY_LEN, AMX_MIN_QUERY_KEY_PAIRS = 32, 1 << 15


class FlashPrefill(LongQueryPath):
    def __init__(self, widen: bool, min_query_len: int, min_query_key_pairs: int) -> None:
        """widen: float32 products (K, V, Q widened at packing) instead of bf16 ones."""
        self.ext = KERNEL.load()
        if self.ext is None:
            raise RuntimeError(f"bf16 prefill attention kernel unavailable: {KERNEL.error}")
        self.widen = widen
        self.min_query_len = min_query_len
        self.min_query_key_pairs = min_query_key_pairs

    def supports(self, params: AttentionParams, head_dim: int) -> bool:
        return head_dim % 2 == 0  # bf16 pairs

    def attend(self, out, q, k_cache, v_cache, reqs, block_tables, scale, params) -> None:
        self.ext.flash_prefill(out, q, k_cache, v_cache, reqs, block_tables, scale, params.sliding_window or 0,
                               params.logit_softcap or 0.0, self.widen)


def for_cpu(paged_kernel_has_avx512: bool, always: bool = False) -> Optional[FlashPrefill]:
    """The path this CPU uses for long bf16 queries, or None where the paged kernel keeps them (or, unless
    always, where this kernel does not build). always: on any CPU (tests), raising if the kernel does not build."""
    ext = KERNEL.load()
    if ext is None and not always:
        return None
    if ext is not None and ext.uses_vnni():
        return FlashPrefill(False, AMX_MIN_QUERY_LEN, AMX_MIN_QUERY_KEY_PAIRS)
    if always or not paged_kernel_has_avx512:
        return FlashPrefill(True, SCALAR_MIN_QUERY_LEN, SCALAR_MIN_QUERY_KEY_PAIRS)
    return None
