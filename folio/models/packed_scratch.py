"""A oneDNN-packed weight per layer shape and dtype, for layers stored narrower than they multiply (quantised
ones, float32 ones kept as bf16: folio.models.bf16_valued) to widen into before a dense GEMM.

A quantised layer multiplies a prefill-sized batch by its weight dequantised for the call. Handed to F.linear as
a plain tensor, that weight is packed by oneDNN again on every call; written instead by the dequantiser straight
into a weight oneDNN packed once (in the layout folio.models.onednn_layout recognises), it goes to the same GEMM
call a bf16 layer's prepacked weight takes. Measured on an AMD EPYC Zen 5 (2 threads, 1852 rows, the 0.5B Qwen2's
layers, `python benchmarks/int4_blocks_bench.py --prefill`), ms per call, F.linear on the plain weight -> the
scratch (bf16's own prepacked weight): int4 gate/up 74.8 -> 62.8 (56.9), down 27.9 -> 21.9 (20.9), q/k/v 5.70 ->
5.22 (5.18); int8 weight-only 71.5 -> 61.2, 27.0 -> 23.4, 6.34 -> 5.55.

One scratch per shape and dtype for the process, made at first use from a probe of distinct values (so that its
layout can be recognised); a use holds its lock from the dequantiser's write to the end of the GEMM, so engines on
two threads never share one mid-call. It costs a copy of each distinct layer shape (the 0.5B Qwen2: 30 MB in
bf16, 60 MB in float32); shapes of more than MAX_BYTES[dtype] (a large vocabulary's lm_head) get none, and
`linear` gives their plain dequantised weight to F.linear, as it does where oneDNN cannot pack bf16.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from folio.models import onednn_layout
from folio.models.onednn_layout import PACK_FOR_BATCH, can_prepack

# bf16: a 7B model's gate/up layer (180 MB) gets one, a 150k vocabulary's lm_head not. float32 (a float32 copy of
# bf16 weights, in place of one for every layer): a 3B model's gate/up (200 MB) too, the 0.5B's lm_head (545) not.
MAX_BYTES = {torch.bfloat16: 192 << 20, torch.float32: 512 << 20}

_scratches: dict[tuple[int, int, torch.dtype], Optional["PackedScratch"]] = {}
_making = threading.Lock()


@dataclass
class PackedScratch:
    packed: torch.Tensor  # oneDNN's packed weight [N, K]
    blocks: torch.Tensor  # its buffer [N' / W, K' / group, W, group] (onednn_layout.vnni_blocks): what is written
    lock: threading.Lock = field(default_factory=threading.Lock)
    # the tensor whose values the blocks hold, weakly, where a writer can skip writing them again (a float32
    # gate/up's pieces: folio.models.bf16_valued); None after any other write
    holding: Optional[weakref.ref] = None


def for_shape(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Optional[PackedScratch]:
    """The scratch for a weight [n, k] of dtype (bf16 or float32), or None where oneDNN cannot pack it here, lays
    it out in a way folio does not recognise, or the weight is larger than MAX_BYTES[dtype]."""
    key = (n, k, dtype)
    if key not in _scratches:
        with _making:
            if key not in _scratches:
                scratch = None
                group = onednn_layout.GROUPS[dtype]
                if n * k * dtype.itemsize <= MAX_BYTES[dtype] and k % group == 0 and can_prepack(dtype):
                    probe = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(dtype)
                    packed = torch.ops.mkldnn._reorder_linear_weight(probe, PACK_FOR_BATCH)
                    blocks = onednn_layout.vnni_blocks(packed, probe, group)
                    scratch = None if blocks is None else PackedScratch(packed, blocks)
                _scratches[key] = scratch
    return _scratches[key]


def linear(x: torch.Tensor, n: int, write: Optional[Callable[[torch.Tensor], None]],
           dequantized: Callable[[], torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias, any float dtype) in x's dtype for a quantised weight [n, K]: for bf16 x, oneDNN's GEMM
    on the scratch of the shape after `write` put the weight into its blocks (in bf16, in their layout); without a
    scratch (or a writer), F.linear on `dequantized()`, the weight [n, K] in any float dtype."""
    scratch = for_shape(n, x.shape[1]) if write is not None and x.dtype == torch.bfloat16 else None
    b = None if bias is None else bias.to(x.dtype)
    if scratch is None:
        return torch.nn.functional.linear(x, dequantized().to(x.dtype), b)
    with scratch.lock:
        write(scratch.blocks)
        scratch.holding = None
        return torch.ops.mkldnn._linear_pointwise(x, scratch.packed, b, "none", [], "")
