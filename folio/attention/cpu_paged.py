"""CPU paged attention: a C++ kernel that reads the paged KV cache in place.

`TorchSDPABackend` copies every request's whole context out of the cache, in every layer of every step,
before it calls SDPA. This backend hands the cache, the block tables and the step's request layout to one
C++ call per layer (folio/csrc/cpu_paged_attention.cpp) that writes the new K/V rows into the cache and then
walks each request's blocks directly: online softmax over tiles of 16 keys (FlashAttention style), float32
accumulation (with a bf16 cache on AVX512-BF16, q.k and P.V are bf16 dot products, P rounded to bf16 as in
torch's CPU flash attention), grouped-query attention without repeating K/V, causal masking offset by the cached context,
a sliding window (each query row starts its keys at its window, and a layer never reads a block before the
window of its request's first query), tanh soft-capping of the scores,
OpenMP over (request, kv heads, query tile) and, when a batch is too small to fill the threads, over
partitions of the context whose partial results are merged afterwards (flash-decoding). Decodes and
prefill chunks go through the same kernel: it also beat SDPA on prefill, even SDPA on pre-gathered K/V
(benchmarks/attention_bench.py --prefill).

The extension is compiled at first use with `torch.utils.cpp_extension.load` (-O3 -march=native; about 15 s
on two cores, it includes only the ATen headers it needs) into $FOLIO_CACHE_DIR (default ~/.cache/folio)
/torch_extensions/<name>_<hash>. The hash covers the source, the flags, torch, Python and the CPU's feature
flags (-march=native code must not reach another CPU); a later process imports the built library directly,
without compiler or ninja. `load_extension()` returns None (after one logged warning) when the build fails:
callers then use TorchSDPABackend (see folio.platforms.cpu).

Handled in place: float32 and bfloat16 caches, any head_dim (AVX-512 code for multiples of 16 up to 256, a
scalar loop otherwise), and 8-bit caches (folio.attention.kv_quant: int8 or fp8 codes with a scale per row,
written and read by the scalar loop). Anything else (float16 caches, q/k/v in another dtype than the cache) goes to the
reference backend for that call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from folio.attention import gemm_prefill, kv_quant
from folio.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionParams, BatchLayout, GroupedMetadata
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.csrc_build import CSRC, CppKernel
from folio.utils.math_utils import cdiv

KERNEL = CppKernel("folio_cpu_paged_attention", CSRC / "cpu_paged_attention.cpp",
                   what="CPU paged attention kernel", fallback="using the torch SDPA reference backend")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Split a context across threads (flash-decoding) only into partitions of at least this many keys.
MIN_SPLIT_KEYS = 64
# Below this many (query row, key) pairs in a call (~40 us on one core), do not use other threads: one
# decode of 384 tokens runs as fast on one thread as split over two, and never waits for a busy core.
MIN_PARALLEL_WORK = 8192


def load_extension(verbose: bool = False):
    """The compiled module, built on first use; None (after one warning) if it cannot be built."""
    return KERNEL.load(verbose)


def extension_error() -> Optional[str]:
    return KERNEL.error


@dataclass
class CPUPagedMetadata:
    layout: BatchLayout
    slot_mapping: torch.Tensor  # [T] int64
    reqs: torch.Tensor  # [B, 3] int32: first token in the batch, query length, context length
    block_tables: torch.Tensor  # [B, max blocks] int32
    # requests attended in GEMMs (folio.attention.gemm_prefill) where the cache is float32: (row of reqs, first
    # token, query length, context length), and reqs / block_tables of the others, for the kernel
    gemm_items: list[tuple[int, int, int, int]] = field(default_factory=list)
    kernel_reqs: Optional[torch.Tensor] = None
    kernel_block_tables: Optional[torch.Tensor] = None
    _reference: Any = field(default=None, repr=False)  # TorchSDPAMetadata, built only if a call needs it


class CPUPagedAttentionBackend(AttentionBackend):
    """Paged attention on the CPU through the C++ kernel; raises RuntimeError if the kernel cannot be built."""

    def __init__(self, min_split_keys: int = MIN_SPLIT_KEYS, min_parallel_work: int = MIN_PARALLEL_WORK,
                 gemm_prefill: Optional[bool] = None) -> None:
        """gemm_prefill: attend long float32 queries in GEMMs (gemm_prefill.py); by default where the kernel
        has no vector code (no AVX-512), which is where that was measured faster."""
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError(f"CPU paged attention kernel unavailable: {KERNEL.error}")
        self.min_split_keys = min_split_keys
        self.min_parallel_work = min_parallel_work
        self.gemm_prefill = not self.ext.has_avx512() if gemm_prefill is None else gemm_prefill
        self.reference = TorchSDPABackend()

    def build_metadata(self, layout: BatchLayout) -> CPUPagedMetadata:
        qlens, slens = layout.query_lens, layout.seq_lens
        b = len(qlens)
        reqs = np.empty((b, 3), dtype=np.int32)
        reqs[:, 0] = np.cumsum(qlens) - qlens
        reqs[:, 1] = qlens
        reqs[:, 2] = slens
        needed = cdiv(int(slens.max()), layout.block_size) if b else 0
        if layout.block_tables.shape[1] < needed:
            raise ValueError(f"block tables have {layout.block_tables.shape[1]} columns, a context needs {needed}")
        tables = layout.block_tables.to(torch.int32).contiguous()
        slot_mapping = layout.slot_mapping.to(torch.int64).contiguous()
        metadata = CPUPagedMetadata(layout, slot_mapping, torch.from_numpy(reqs), tables)
        long_queries = (qlens >= gemm_prefill.MIN_QUERY_LEN) & (qlens * slens >= gemm_prefill.MIN_QUERY_KEY_PAIRS)
        long_queries &= self.gemm_prefill
        if long_queries.any():
            metadata.gemm_items = [(i, *map(int, reqs[i])) for i in np.flatnonzero(long_queries)]
            short = np.flatnonzero(~long_queries)
            metadata.kernel_reqs = torch.from_numpy(np.ascontiguousarray(reqs[short]))
            metadata.kernel_block_tables = tables[torch.from_numpy(short)].contiguous()
        return metadata

    def forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata,
                params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        if isinstance(metadata, GroupedMetadata):
            metadata = metadata.of(kv_cache)
        k_cache, v_cache = kv_cache
        dtype = q.dtype
        cache_ok = k_cache.dtype == dtype or kv_quant.of_cache(k_cache) is not None
        if dtype not in SUPPORTED_DTYPES or not k_cache.is_cpu or not (q.dtype == k.dtype == v.dtype and cache_ok):
            return self._reference_forward(q, k, v, kv_cache, metadata, params)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        out = torch.empty(q.shape, dtype=dtype)
        # the GEMM path computes plain causal attention; windows and soft-capping stay on the kernel
        plain = params.sliding_window is None and params.logit_softcap is None
        gemm_items = metadata.gemm_items if plain and k_cache.dtype == torch.float32 else []
        reqs, tables = (metadata.kernel_reqs, metadata.kernel_block_tables) if gemm_items else \
            (metadata.reqs, metadata.block_tables)
        scale = params.scale_for(q.shape[-1])
        # the kernel writes every new K/V row, and attends the requests left to it
        self.ext.paged_attention(out, q, k, v, k_cache, v_cache, metadata.slot_mapping, reqs, tables, scale,
                                 params.sliding_window or 0, params.logit_softcap or 0.0, self.min_split_keys,
                                 self.min_parallel_work)
        for row, first_token, query_len, context_len in gemm_items:
            gemm_prefill.attend(out, q, k_cache, v_cache, metadata.block_tables[row], first_token, query_len,
                                context_len, scale)
        return out

    def _reference_forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata,
                           params: AttentionParams) -> torch.Tensor:
        if metadata._reference is None:
            metadata._reference = self.reference.build_metadata(metadata.layout)
        return self.reference.forward(q, k, v, kv_cache, metadata._reference, params)
