"""The gated layout: a SwiGLU gate/up weight's rows as runs of GATED_RUN gates, each followed by the same outputs'
ups, for the kernels whose epilogue computes SiLU-and-mul (the int8 one on AMX-INT8: folio.models.onednn_int8;
the dense bf16 one on AMX tiles: folio.models.dense_linear). A 32-column block of the packed weight is then all
gates or all ups, and a pair of blocks holds both halves of 32 outputs, so an epilogue writes silu(gate) * up
without the op's pass over a product twice its size.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.models import fused_ops
from folio.models.layers import silu_and_mul

# a gated weight's rows go in runs of this many gates, then their ups (as the kernels read them: cpu_fused_ops.cpp's
# GATED_RUN, cpu_quant_linear.cpp's 64-column blocks, pairs of cpu_small_batch_gemm.cpp's 32-column ones)
GATED_RUN = 32


def interleave_gated(rows: torch.Tensor) -> torch.Tensor:
    """A gate/up layer's rows (or per-row values) [2 I, ...], gates first, in the gated layout: runs of GATED_RUN
    gates each followed by the same outputs' ups."""
    i = rows.shape[0] // 2
    order = torch.arange(2 * i).view(2, i // GATED_RUN, GATED_RUN).transpose(0, 1).reshape(-1)
    return rows[order]


def silu_table(output_size: int) -> Optional[torch.Tensor]:
    """fused_ops.bf16_silu_table for a gate/up of output_size rows that can take the gated layout, else None: a
    multiple of 64 outputs, whose rows the op takes through its table alone, as a fused epilogue does."""
    return fused_ops.bf16_silu_table() if output_size % (4 * GATED_RUN) == 0 else None


def plain_order(product: torch.Tensor) -> torch.Tensor:
    """A product [..., 2 I] whose columns are in the gated layout, gates first again (a copy)."""
    n = product.shape[-1]
    runs = product.reshape(*product.shape[:-1], n // (2 * GATED_RUN), 2, GATED_RUN)
    return runs.transpose(-3, -2).reshape(product.shape)


def silu_and_mul_gated(product: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu_and_mul of a product whose columns are in the gated layout, [..., I] in the outputs' order (into `out`,
    for a 2-D product, if given): read in place by the fused kernel where it serves it, else the op over the
    product in plain order."""
    result = fused_ops.silu_and_mul_runs(product, out)
    if result is not None:
        return result
    result = silu_and_mul(plain_order(product))
    return result if out is None else out.copy_(result)
