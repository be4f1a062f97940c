"""EngineConfig: every knob of the engine in one validated dataclass (the LLM kwargs and the CLI flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from folio.platforms.cpu_features import has_fast_bf16


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # HF folder or .gguf file; None = the embedded default model
    dtype: Union[str, torch.dtype] = "auto"
    block_size: int = 16
    # KV cache budget: bytes (int > 1) or a fraction of the memory available at start (float in (0, 1]).
    kv_cache_memory: Union[int, float, None] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None
    scheduling_policy: str = "fcfs"  # or "priority"
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of earlier prompts (block_size = unit)
    seed: int = 0
    num_threads: Optional[int] = None  # torch intra-op threads; None = the cores this process may use

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.kv_cache_memory is not None and not (
                (isinstance(self.kv_cache_memory, float) and 0.0 < self.kv_cache_memory <= 1.0)
                or (isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 1)):
            raise ValueError("kv_cache_memory must be a byte count (int) or a fraction of free memory in (0, 1], "
                             f"got {self.kv_cache_memory!r}")
        self.torch_dtype  # validates dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if has_fast_bf16() else torch.float32
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}") from None
