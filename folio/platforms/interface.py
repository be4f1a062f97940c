"""Platform: everything folio decides by the hardware it runs on, in one object.

The engine asks its platform, and nothing else, for: the device every tensor lives on, the dtype `auto`
means, how much memory the KV cache may take, which attention backend runs (and which ones exist), which
linear method computes the models' matmuls, how the process is set up (threads, allocator), the flags its
C++ kernels are built with, and how tensor-parallel workers talk (torch.distributed's backend). The CPU is the
one platform today (folio.platforms.cpu); a CUDA platform is another subclass, chosen in
`folio.platforms.current_platform`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import TYPE_CHECKING, ContextManager, Optional, Union

import torch
from torch import nn

from folio.attention.backend import AttentionBackend

if TYPE_CHECKING:  # (folio.models.linear imports the fused ops, whose build asks the platform)
    from folio.models.linear import LinearMethods


class Platform(ABC):
    name: str
    device: torch.device
    distributed_backend: str  # torch.distributed's backend among tensor-parallel workers (gloo, nccl)

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """What dtype="auto" means here: the fastest dtype whose results stay close to float32's."""

    @abstractmethod
    def prepare_process(self, num_threads: Optional[int]) -> None:
        """Set the process up to run steps (thread count, allocator); called once, before loading weights."""

    def step_threads(self, num_tokens: int) -> ContextManager[None]:
        """The threads a step of num_tokens tokens runs on, set up within (the CPU's decode threads); by default
        nothing changes."""
        return nullcontext()

    @abstractmethod
    def kv_cache_budget(self, setting: Union[int, float, None]) -> int:
        """Bytes the KV cache may take: an explicit byte count, a fraction of the memory available, or the
        platform's default (None)."""

    @abstractmethod
    def attention_backends(self) -> tuple[str, ...]:
        """Names of the attention backends this platform can run, fastest first."""

    @abstractmethod
    def attention_backend(self, name: Optional[str]) -> AttentionBackend:
        """The named backend (one of attention_backends()), or for None the fastest that works here."""

    @abstractmethod
    def linear_method(self, model: nn.Module, quantization: Optional[str] = None) -> LinearMethods:
        """The linear method (or per-layer chooser) of a built model whose weights are not loaded yet, for a
        quantization scheme (the engine option) or none."""

    @abstractmethod
    def kernel_build_flags(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(compiler flags, linker flags) of folio's C++ kernels (folio.csrc_build) on this platform."""
