"""Rows of x that test a kernel's 16-bit codes (quant_reference.quantize_rows_int16) at their edges."""

from __future__ import annotations

import torch

from folio.models import quant_reference as ref


def hard_rows(k: int) -> torch.Tensor:
    """6 rows of k values: random, zero (scale 1), one outlier setting its row's scale, halves that are ties
    (a row whose scale is 1), tiny values, random."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, k, generator=g)
    x[1] = 0
    x[2, 7] = 1e4
    x[3] = torch.arange(k) - 40.5
    x[3, 0] = ref.INT16_CODE_MAX
    x[4] *= 1e-30
    assert bool(ref.quantize_rows_int16(x)[1][[1, 3]].eq(1).all())
    return x
