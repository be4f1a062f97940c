"""An int4 layer's weight for tests, read back from float32 column blocks (folio.models.int4_blocks), whose
kernel takes every batch and so has no dequantiser of its own."""

from __future__ import annotations

import torch

from folio.models import int4_blocks
from folio.models import quant_reference as ref


def int4_rows(blocks: int4_blocks.Int4Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks in quant_reference's row-major format: (packed uint8 [N, K / 2], scales, offsets [N, K / G]).
    Word i of a block's pair p holds in nibble v the code of column 16 v + i // 2 at k = 2 p + i % 2; the
    blocks' scales are 16 times the group's (exact: a power of two)."""
    nb, pairs, _ = blocks.codes.shape
    words = blocks.codes.view(torch.int16).view(nb, pairs, 16, 2).to(torch.int32) & 0xFFFF  # [b, p, l, k % 2]
    nibbles = torch.stack([(words >> (4 * v)) & 15 for v in range(4)], dim=2)  # [b, p, v, l, k % 2]
    q = nibbles.permute(0, 2, 3, 1, 4).reshape(nb * 64, 2 * pairs)[:blocks.out_features]
    return ref.pack_int4(q.to(torch.uint8)), _columns(blocks.scales, blocks.out_features) / 16, \
        _columns(blocks.offsets, blocks.out_features)


def _columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N / 64, G', 64] per block -> [N, G'] per output column, in float32."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].float()
