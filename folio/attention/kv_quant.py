"""8-bit KV cache: each (token, kv head) row of K or V stored as head_dim 8-bit codes followed by its float32
scale, in one byte row of head_dim + 4 (`kv_cache_dtype` "int8" or "fp8").

A row's scale is its own max |value| over the code's largest value (127 for int8, 448 for fp8 e4m3), so no
calibration is needed and an outlier token or head costs only its own row's precision (vLLM's fp8 cache keeps
one scale per tensor, from a checkpoint or computed once, and clips whatever exceeds it). The scale sits beside
its codes, in the same cache line, so the cache stays one tensor per layer and K/V, addressed by slot exactly
as an unquantised one; at head_dim 64 a row takes 68 bytes instead of 128 (bf16) or 256 (float32).

The storage dtype names the code: int8 rows are torch.int8, fp8 rows torch.uint8 holding e4m3 bit patterns,
so a backend tells the format from the cache tensor alone (`of_cache`). The C++ paged attention kernel
(folio/csrc/cpu_paged_attention.cpp) encodes exactly as `quantize` does, so both backends write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCALE_BYTES = 4


@dataclass(frozen=True)
class KVQuantization:
    name: str
    storage_dtype: torch.dtype
    code_dtype: torch.dtype  # what the storage bytes are viewed as
    max_code: float

    def row_size(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] float -> rows [..., D + 4] in storage_dtype: codes of x / scale, then the scale's bytes."""
        x = x.float()
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / self.max_code, torch.ones_like(amax))
        scaled = x / scale
        codes = (torch.round(scaled).clamp(-self.max_code, self.max_code) if self.name == "int8" else scaled)
        rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=self.storage_dtype)
        rows[..., :x.shape[-1]].view(self.code_dtype).copy_(codes.to(self.code_dtype))
        rows[..., x.shape[-1]:].view(torch.float32).copy_(scale)
        return rows

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., D + 4] -> [..., D] in dtype (codes times scale in float32, then one rounding)."""
        head_dim = rows.shape[-1] - SCALE_BYTES
        codes = rows[..., :head_dim].view(self.code_dtype).float()
        return (codes * rows[..., head_dim:].contiguous().view(torch.float32)).to(dtype)


KV_QUANTIZATIONS = {
    "int8": KVQuantization("int8", torch.int8, torch.int8, 127.0),
    "fp8": KVQuantization("fp8", torch.uint8, torch.float8_e4m3fn, 448.0),
}


def of_cache(cache: torch.Tensor) -> Optional[KVQuantization]:
    """The 8-bit format of a cache tensor, or None for a cache in the model's dtype."""
    return next((q for q in KV_QUANTIZATIONS.values() if q.storage_dtype == cache.dtype), None)
