"""float32 layers whose weights hold only bf16 values (a bf16 checkpoint run in float32), kept in bf16.

On a CPU without fast bf16 arithmetic (AVX2) folio runs in float32, and most checkpoints are stored in bf16:
each weight then widens exactly, and a float32 copy holds the same values in twice the bytes. The dense method
keeps such a weight as bf16 blocks in the layout oneDNN gives its float32 weights (`narrowed`), loaded as bf16
where the checkpoint stores it so (weight_loader.keep_bf16_tensors): no float32 copy is made, at load or after. The
small-batch kernel reads the blocks in place, widening each vector as it loads it
(folio/csrc/cpu_small_batch_gemm.cpp): the same FMAs on the same values, bit for bit the float32 kernel's
results. Decode reads half the bytes, and the model half the memory (the 0.5B Qwen2: 1.0 GB of weights instead
of 2.0).

Batches past the kernel's rows (prefill chunks) go to oneDNN's float32 GEMM on a packed scratch of the layer's
shape (folio.models.packed_scratch), the blocks widened into it first: a copy, since the two layouts are the
same, skipped where the scratch still holds this weight (a gate/up's pieces: dense_linear.SILU_PIECE_ROWS).
Shapes too large for a scratch (a large vocabulary's lm_head, which sees a prefill step's last tokens and a
decode step's rows) run the kernel on MAX_ROWS rows at a time.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from folio.models import packed_scratch, small_batch_gemm
from folio.models.small_batch_gemm import PackedWeight

CHECK_BYTES = 4 << 20  # float32 values checked (holds_bf16_values) and laid out (`narrowed`) at a time


def available() -> bool:
    """Whether the kernel that reads bf16 blocks as float32 is built here."""
    return small_batch_gemm.available(torch.float32)


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 weight is a bf16 one (a bf16 weight's are), checked a few MB at a time."""
    if weight.dtype == torch.bfloat16:
        return True
    rows = max(1, CHECK_BYTES // (weight.shape[1] * 4))
    return all(torch.equal(part.to(torch.bfloat16).to(torch.float32), part) for part in weight.split(rows))


def narrowed(weight: torch.Tensor) -> Optional[PackedWeight]:
    """A float32 layer's weight [N, K] (as loaded: float32, or bf16 kept so by weight_loader.keep_bf16_tensors) as bf16
    blocks [ceil(N / W), K', W, 1] in the layout oneDNN gives a float32 weight of its shape (its scratch's), where
    every value is a bf16 one and the kernel is built; else None, and the weight stays on its float32 path. A
    shape too large for a scratch (a large vocabulary's lm_head, whose batches are a step's sampled rows) takes
    blocks of 64 columns and K' = K; one whose scratch oneDNN cannot give (a layout folio does not recognise)
    is not narrowed, so its prefill keeps oneDNN's GEMM. Laid out a few MB at a time, so that it adds no float32
    copy of a layer (a tied lm_head: 545 MB for the 0.5B Qwen2) to the load's peak."""
    if (weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2 or not weight.is_cpu
            or not available() or not holds_bf16_values(weight)):
        return None
    n, k = weight.shape
    scratch = packed_scratch.for_shape(n, k, torch.float32)
    if scratch is None and n * k * 4 <= packed_scratch.MAX_BYTES[torch.float32]:
        return None
    width, padded_k = (scratch.blocks.shape[2], scratch.blocks.shape[1]) if scratch is not None else (64, k)
    blocks = torch.zeros(-(-n // width), padded_k, width, 1, dtype=torch.bfloat16)
    step = max(1, CHECK_BYTES // (width * k * 4))
    for b in range(0, blocks.shape[0], step):
        narrow = weight[b * width:(b + step) * width].to(torch.bfloat16)
        whole = -(-narrow.shape[0] // width) * width
        if whole != narrow.shape[0]:  # the last block's columns past N stay zero
            narrow = torch.cat([narrow, narrow.new_zeros(whole - narrow.shape[0], k)])
        blocks[b:b + whole // width, :k, :, 0] = narrow.view(-1, width, k).transpose(1, 2)
    return PackedWeight(blocks, n, k)


def linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] (float32) @ weight^T (+ bias) for bf16-valued blocks (`narrowed`), any number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    limit = small_batch_gemm.MAX_ROWS[torch.float32]
    if rows.shape[0] <= limit:
        out = small_batch_gemm.linear(rows, weight, bias)
    else:
        scratch = packed_scratch.for_shape(weight.out_features, weight.in_features, torch.float32)
        if scratch is not None:  # `narrowed` laid the blocks out as the scratch's
            with scratch.lock:
                if scratch.holding is None or scratch.holding() is not weight.blocks:
                    scratch.blocks.copy_(weight.blocks)
                    scratch.holding = weakref.ref(weight.blocks)
                out = torch.ops.mkldnn._linear_pointwise(rows, scratch.packed, bias, "none", [], "")
        else:
            out = torch.cat([small_batch_gemm.linear(rows[r:r + limit], weight, bias)
                             for r in range(0, rows.shape[0], limit)])
    return out.view(*x.shape[:-1], weight.out_features)
