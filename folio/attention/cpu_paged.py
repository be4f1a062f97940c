"""CPU paged attention: a C++ kernel that reads the paged KV cache in place.

`TorchSDPABackend` copies every request's whole context out of the cache, in every layer of every step,
before it calls SDPA. This backend hands the cache, the block tables and the step's request layout to one
C++ call per layer (folio/csrc/cpu_paged_attention.cpp) that writes the new K/V rows into the cache and then
walks each request's blocks directly: online softmax over tiles of 16 keys (FlashAttention style), float32
accumulation (with a bf16 cache on AVX512-BF16, q.k and P.V are bf16 dot products, P rounded to bf16 as in
torch's CPU flash attention), grouped-query attention without repeating K/V, causal masking offset by the cached context,
a sliding window (each query row starts its keys at its window, and a layer never reads a block before the
window of its request's first query), tanh soft-capping of the scores, attention sinks (GPT-OSS),
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

Long queries (prompts, prefill chunks) go to a matrix-product path for the cache's dtype
(folio.attention.long_query) where the kernel is slower (`long_query_paths`): PyTorch's flash attention
(sdpa_prefill) for float32 caches without AVX-512, brgemm tiles (flash_prefill) for bf16 and 8-bit caches without
AVX-512 (float32 products), and bf16 and 8-bit caches with AVX512-BF16 or AMX (bf16 products); the kernel still
writes their K/V rows and attends the rest of the step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from folio.attention import flash_prefill, kv_quant, sdpa_prefill
from folio.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionParams, BatchLayout
from folio.attention.long_query import LongQueryPath
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.csrc_build import CSRC, CppKernel
from folio.platforms.cpu_features import has_amx
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


PathMaker = Callable[[], Optional[LongQueryPath]]


def long_query_paths(kernel_has_avx512: bool) -> dict[torch.dtype, PathMaker]:
    """Where long queries go on this CPU instead of the kernel, by cache dtype (each path made at first use; None
    or no entry: the kernel). Without AVX-512 the kernel's loop is AVX2 in float32, and both matrix-product paths
    beat it on long queries (float32 from longer ones than bf16 and 8-bit caches: sdpa_prefill's rule); with
    AVX-512 its vector code keeps short queries, and long ones on bf16 and 8-bit caches go to bf16 products on
    oneDNN's micro-kernel (AMX tiles where the CPU has them)."""
    if not kernel_has_avx512:
        eight_bit = {quant.storage_dtype: flash_prefill.if_built for quant in kv_quant.KV_QUANTIZATIONS.values()}
        return {torch.float32: functools.partial(sdpa_prefill.SdpaPrefill, *sdpa_prefill.FLOAT32_WITHOUT_AVX512),
                torch.bfloat16: flash_prefill.if_built, **eight_bit}
    bf16, eight_bit = ((flash_prefill.BF16_PRODUCTS_AMX, flash_prefill.EIGHT_BIT_PRODUCTS_AMX) if has_amx()
                       else (flash_prefill.BF16_PRODUCTS, flash_prefill.EIGHT_BIT_PRODUCTS))
    return {torch.bfloat16: functools.partial(flash_prefill.bf16_products_if_built, *bf16),
            **{quant.storage_dtype: functools.partial(flash_prefill.bf16_products_if_built, *eight_bit)
               for quant in kv_quant.KV_QUANTIZATIONS.values()}}


@dataclass
class RequestSplit:
    """A step's requests split between a long-query path (folio.attention.long_query) and the kernel."""

    long_reqs: torch.Tensor  # rows of CPUPagedMetadata.reqs and block_tables the path attends
    long_block_tables: torch.Tensor
    kernel_reqs: torch.Tensor  # and those of the others
    kernel_block_tables: torch.Tensor


@dataclass
class CPUPagedMetadata:
    layout: BatchLayout
    slot_mapping: torch.Tensor  # [T] int64
    reqs: torch.Tensor  # [B, 3] int32: first token in the batch, query length, context length
    block_tables: torch.Tensor  # [B, max blocks] int32
    # per cache dtype with a long-query path: its split of the step (None: no request for it), made at the
    # step's first layer of that dtype
    splits: dict[torch.dtype, Optional[RequestSplit]] = field(default_factory=dict)
    _reference: Any = field(default=None, repr=False)  # TorchSDPAMetadata, built only if a call needs it

    def split_for(self, dtype: torch.dtype, path: LongQueryPath) -> Optional[RequestSplit]:
        if dtype not in self.splits:
            long = path.is_long(self.layout.query_lens, self.layout.seq_lens)
            split = None
            if long.any():
                rows, others = torch.from_numpy(np.flatnonzero(long)), torch.from_numpy(np.flatnonzero(~long))
                split = RequestSplit(self.reqs[rows].contiguous(), self.block_tables[rows].contiguous(),
                                     self.reqs[others].contiguous(), self.block_tables[others].contiguous())
            self.splits[dtype] = split
        return self.splits[dtype]


class CPUPagedAttentionBackend(AttentionBackend):
    """Paged attention on the CPU through the C++ kernel; raises RuntimeError if the kernel cannot be built."""

    def __init__(self, min_split_keys: int = MIN_SPLIT_KEYS, min_parallel_work: int = MIN_PARALLEL_WORK,
                 long_queries: Optional[dict[torch.dtype, PathMaker]] = None) -> None:
        """long_queries: the long-query path of each cache dtype (default: `long_query_paths` for this CPU; {}:
        the kernel attends everything)."""
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError(f"CPU paged attention kernel unavailable: {KERNEL.error}")
        self.min_split_keys = min_split_keys
        self.min_parallel_work = min_parallel_work
        self._path_makers = long_query_paths(self.ext.has_avx512()) if long_queries is None else long_queries
        self._paths: dict[torch.dtype, Optional[LongQueryPath]] = {}
        self.reference = TorchSDPABackend()

    def long_query_path(self, dtype: torch.dtype) -> Optional[LongQueryPath]:
        """The path long queries take with a cache of this dtype, made at first use; None: the kernel."""
        if dtype not in self._paths:
            make = self._path_makers.get(dtype)
            self._paths[dtype] = make() if make is not None else None
        return self._paths[dtype]

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
        return CPUPagedMetadata(layout, slot_mapping, torch.from_numpy(reqs), tables)

    def forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata,
                params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
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
        path = self.long_query_path(k_cache.dtype)
        split = metadata.split_for(k_cache.dtype, path) if path and path.supports(params, q) else None
        reqs, tables = (split.kernel_reqs, split.kernel_block_tables) if split else \
            (metadata.reqs, metadata.block_tables)
        scale = params.scale_for(q.shape[-1])
        # the kernel writes every new K/V row, and attends the requests left to it
        out = self.ext.paged_attention(q, k, v, k_cache, v_cache, metadata.slot_mapping, reqs, tables, scale,
                                 params.sliding_window or 0, params.logit_softcap or 0.0, params.sinks,
                                 self.min_split_keys, self.min_parallel_work)
        if split:
            path.attend(out, q, k_cache, v_cache, split.long_reqs, split.long_block_tables, scale, params)
        return out

    def _reference_forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata,
                           params: AttentionParams) -> torch.Tensor:
        if metadata._reference is None:
            metadata._reference = self.reference.build_metadata(metadata.layout)
        return self.reference.forward(q, k, v, kv_cache, metadata._reference, params)
