"""CPU paged attention: a C++ kernel that reads the paged KV cache in place.

`TorchSDPABackend` copies every request's whole context out of the cache, in every layer of every step,
before it calls SDPA. This backend hands the cache, the block tables and the step's request layout to one
C++ call per layer (folio/csrc/cpu_paged_attention.cpp) that writes the new K/V rows into the cache and then
walks each request's blocks directly: online softmax over tiles of 16 keys (FlashAttention style), float32
accumulation, grouped-query attention without repeating K/V, causal masking offset by the cached context,
OpenMP over (request, kv heads, query tile) and, when a batch is too small to fill the threads, over
partitions of the context whose partial results are merged afterwards (flash-decoding). Decodes and
prefill chunks go through the same kernel: it also beat SDPA on prefill, even SDPA on pre-gathered K/V
(benchmarks/attention_bench.py --prefill).

The extension is compiled at first use with `torch.utils.cpp_extension.load` (-O3 -march=native; about 15 s
on two cores, it includes only the ATen headers it needs) into $FOLIO_CACHE_DIR (default ~/.cache/folio)
/torch_extensions/<name>_<hash>. The hash covers the source, the flags, torch, Python and the CPU's feature
flags (-march=native code must not reach another CPU); a later process imports the built library directly,
without compiler or ninja. `load_extension()` returns None (after one logged warning) when the build fails:
callers then use TorchSDPABackend (see folio.attention.selector).

Handled in place: float32 and bfloat16 caches, any head_dim (AVX-512 code for multiples of 16 up to 256, a
scalar loop otherwise). Anything else (float16 caches, q/k/v in another dtype than the cache) goes to the
reference backend for that call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from folio.attention.backend import AttentionBackend, BatchLayout
from folio.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_paged_attention.cpp"
EXT_NAME = "folio_cpu_paged_attention"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-unused-function"]
LDFLAGS = ["-fopenmp"]
# A build lock older than this is taken to be left over from a killed build (a build takes ~15 s).
STALE_LOCK_S = 15 * 60
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Split a context across threads (flash-decoding) only into partitions of at least this many keys.
MIN_SPLIT_KEYS = 64
# Below this many (query row, key) pairs in a call (~40 us on one core), do not use other threads: one
# decode of 384 tokens runs as fast on one thread as split over two, and never waits for a busy core.
MIN_PARALLEL_WORK = 8192

_lock = threading.Lock()
_ext: Any = None
_ext_error: Optional[str] = None
_ext_tried = False


def cache_root() -> Path:
    """Where built kernels live: $FOLIO_CACHE_DIR (default ~/.cache/folio) / torch_extensions."""
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "folio")
    return Path(root) / "torch_extensions"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """Hash of everything the built library depends on: -march=native ties it to this CPU's features."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), platform.machine().encode(), _cpu_flags().encode(),
                 os.environ.get("CXX", "c++").encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _import_built(name: str, folder: Path):
    path = folder / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load(verbose: bool = False):
    name = f"{EXT_NAME}_{build_key()}"
    folder = cache_root() / name
    if (folder / "ok").exists() and (folder / f"{name}.so").exists():
        return _import_built(name, folder)  # built by an earlier process: no compiler, no ninja
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()  # torch's FileBaton would wait for it forever
    except OSError:
        pass
    from torch.utils import cpp_extension

    start = time.perf_counter()
    logger.info("building the CPU paged attention kernel in %s (first use only; about 15 s)", folder)
    module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                                build_directory=str(folder), verbose=verbose, with_cuda=False)
    (folder / "ok").write_text(f"{time.perf_counter() - start:.1f} s\n")
    logger.info("built the CPU paged attention kernel in %.1f s", time.perf_counter() - start)
    return module


def load_extension(verbose: bool = False):
    """The compiled kernel module, building it on first use; None (with one warning) if it cannot be built."""
    global _ext, _ext_error, _ext_tried
    with _lock:
        if not _ext_tried:
            _ext_tried = True
            if os.environ.get("FOLIO_DISABLE_CPU_KERNELS") == "1":
                _ext_error = "disabled by FOLIO_DISABLE_CPU_KERNELS=1"
            else:
                try:
                    _ext = _build_and_load(verbose)
                except Exception as exc:  # a compiler error, no ninja, a read-only cache dir...
                    _ext_error = f"{type(exc).__name__}: {exc}"
            if _ext_error is not None:
                logger.debug("CPU paged attention kernel build error:\n%s", _ext_error)
                logger.warning("CPU paged attention kernel unavailable (%s); using the torch SDPA reference "
                               "backend", _ext_error.strip().splitlines()[0][:500])
        return _ext


def extension_error() -> Optional[str]:
    return _ext_error


@dataclass
class CPUPagedMetadata:
    layout: BatchLayout
    slot_mapping: torch.Tensor  # [T] int64
    reqs: torch.Tensor  # [B, 3] int32: first token in the batch, query length, context length
    block_tables: torch.Tensor  # [B, max blocks] int32, zero padded
    _reference: Any = field(default=None, repr=False)  # TorchSDPAMetadata, built only if a call needs it


class CPUPagedAttentionBackend(AttentionBackend):
    """Paged attention on the CPU through the C++ kernel; raises RuntimeError if the kernel cannot be built."""

    def __init__(self, min_split_keys: int = MIN_SPLIT_KEYS, min_parallel_work: int = MIN_PARALLEL_WORK) -> None:
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError(f"CPU paged attention kernel unavailable: {_ext_error}")
        self.min_split_keys = min_split_keys
        self.min_parallel_work = min_parallel_work
        self.reference = TorchSDPABackend()

    def build_metadata(self, layout: BatchLayout) -> CPUPagedMetadata:
        bs = layout.block_size
        qlens = np.asarray(layout.query_lens, dtype=np.int64)
        slens = np.asarray(layout.seq_lens, dtype=np.int64)
        b = len(qlens)
        reqs = np.empty((b, 3), dtype=np.int32)
        reqs[:, 0] = np.cumsum(qlens) - qlens
        reqs[:, 1] = qlens
        reqs[:, 2] = slens
        nblocks = (slens + bs - 1) // bs
        tables = np.zeros((b, int(nblocks.max()) if b else 0), dtype=np.int32)
        for i, (table, n) in enumerate(zip(layout.block_tables, nblocks.tolist())):
            if len(table) < n:
                raise ValueError(f"request {i}: block table has {len(table)} blocks, context needs {n}")
            tables[i, :n] = table[:n]
        slot_mapping = layout.slot_mapping.to(torch.int64).contiguous()
        return CPUPagedMetadata(layout, slot_mapping, torch.from_numpy(reqs), torch.from_numpy(tables))

    def forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        dtype = k_cache.dtype
        if dtype not in SUPPORTED_DTYPES or not k_cache.is_cpu or not q.dtype == k.dtype == v.dtype == dtype:
            return self._reference_forward(q, k, v, kv_cache, metadata)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        out = torch.empty(q.shape, dtype=dtype)
        self.ext.paged_attention(out, q, k, v, k_cache, v_cache, metadata.slot_mapping, metadata.reqs,
                                 metadata.block_tables, q.shape[-1] ** -0.5, self.min_split_keys,
                                 self.min_parallel_work)
        return out

    def _reference_forward(self, q, k, v, kv_cache, metadata: CPUPagedMetadata) -> torch.Tensor:
        if metadata._reference is None:
            metadata._reference = self.reference.build_metadata(metadata.layout)
        return self.reference.forward(q, k, v, kv_cache, metadata._reference)
