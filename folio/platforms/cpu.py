"""The CPU platform: x86 with AVX2, AVX-512, AVX512-BF16 or AMX, or Arm, on whatever cores the process may use.

- dtype auto: bfloat16 where AMX or AVX512-BF16 make bf16 matmuls fast, else float32 (bf16 emulated in
  software is slower than float32).
- KV cache: by default the smaller of 4 GiB and 40% of the memory available at start (vLLM's CPU build takes
  4 GiB by default).
- attention: the C++ paged-attention kernel (folio.attention.cpu_paged) where it builds, else torch SDPA.
- matmuls: the dense CPU linear method (oneDNN prepacked bf16, the small-batch kernel, MKL in float32), or a
  quantisation scheme's (folio.models.quantization: int8 and int4 kernels) with the dense one for the rest.
- the process: one torch thread per core it may use, counted as folio is imported and within a cgroup's CPU
  quota, or OMP_NUM_THREADS (folio.thread_count), and freed memory kept for reuse (folio.memory); steps of one
  token run folio's kernels on the decode threads (folio.platforms.decode_threads).
- kernels: built with -march=native for this CPU (the build key includes its feature flags).
- tensor-parallel workers: gloo, each worker on its share of the cores (folio.distributed.parallel_state).
"""

from __future__ import annotations

import logging
from typing import ContextManager, Optional, Union

import torch
from torch import nn

from folio import envs, thread_count
from folio.attention.backend import AttentionBackend
from folio.memory import available_memory_bytes, keep_freed_memory
from folio.models.linear import LinearMethods
from folio.platforms import decode_threads
from folio.platforms.cpu_features import has_fast_bf16
from folio.platforms.interface import Platform

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 4 << 30
DEFAULT_KV_CACHE_FRACTION = 0.4
KERNEL_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-Wno-unused-function")
KERNEL_LDFLAGS = ("-fopenmp",)


class CpuPlatform(Platform):
    name = "cpu"
    device = torch.device("cpu")
    distributed_backend = "gloo"

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if has_fast_bf16() else torch.float32

    def prepare_process(self, num_threads: Optional[int]) -> None:
        torch.set_num_threads(num_threads or thread_count.default())
        keep_freed_memory()  # every step's large activations reuse the heap instead of faulting pages in

    def step_threads(self, num_tokens: int) -> ContextManager[None]:
        return decode_threads.threads_for_step(num_tokens)

    def kv_cache_budget(self, setting: Union[int, float, None]) -> int:
        if isinstance(setting, int):
            return setting
        if isinstance(setting, float):
            return int(setting * available_memory_bytes())
        return min(DEFAULT_KV_CACHE_BYTES, int(DEFAULT_KV_CACHE_FRACTION * available_memory_bytes()))

    def attention_backends(self) -> tuple[str, ...]:
        return ("cpu_paged", "torch_sdpa")

    def attention_backend(self, name: Optional[str]) -> AttentionBackend:
        """The named backend, else $FOLIO_ATTENTION_BACKEND, else cpu_paged where its kernel builds. A
        cpu_paged whose kernel cannot be built falls back to torch_sdpa with a warning rather than stopping
        the engine (FOLIO_DISABLE_CPU_KERNELS=1 skips the build altogether)."""
        from folio.attention import cpu_paged  # imports its kernel's build machinery, which imports this module
        from folio.attention.torch_sdpa import TorchSDPABackend

        choice = name or envs.attention_backend()
        if choice is not None and choice not in self.attention_backends():
            source = "attention_backend" if name else "FOLIO_ATTENTION_BACKEND"
            raise ValueError(f"{source} must be one of {', '.join(self.attention_backends())}, got {choice!r}")
        if choice == "torch_sdpa":
            return TorchSDPABackend()
        if cpu_paged.load_extension() is not None:  # logs a warning itself when the build fails
            return cpu_paged.CPUPagedAttentionBackend()
        if choice == "cpu_paged":
            logger.warning("the cpu_paged attention backend was asked for, but its kernel is unavailable (%s); "
                           "using torch_sdpa", cpu_paged.extension_error())
        return TorchSDPABackend()

    def linear_method(self, model: nn.Module, quantization: Optional[str] = None) -> LinearMethods:
        from folio.models.dense_linear import DenseLinearMethod  # its kernels' build machinery imports this module
        from folio.models.quantization import quantization_chooser

        dense = DenseLinearMethod()
        return dense if quantization is None else quantization_chooser(quantization, dense)

    def kernel_build_flags(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return KERNEL_CFLAGS, KERNEL_LDFLAGS
