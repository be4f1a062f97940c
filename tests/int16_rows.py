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


def assert_batch_invariant(linear, k: int) -> None:
    """linear(x) [M, k] -> [M, N] gives each row of x bit for bit the same result alone and in batches of every
    size the AVX2 kernels split differently (csrc/int16_tiles.h: row loops for 1-2 rows, tiles from 3, panels
    of up to 48 rows and passes of up to 3, both spread evenly), hard rows included."""
    x = torch.cat([hard_rows(k), torch.randn(94, k, generator=torch.Generator().manual_seed(k))])
    alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
    for m in (2, 3, 4, 5, 7, 47, 48, 49, 97, len(x)):
        assert torch.equal(linear(x[:m]), alone[:m]), m
    assert torch.equal(linear(x[50:]), alone[50:])  # rows in other places of their panels and passes
