"""An int8 layer's weight for tests, wherever the layer keeps it."""

from __future__ import annotations

import torch

from folio.models import gated_layout
from folio.models.linear import Linear


def int8_weight(layer: Linear) -> torch.Tensor:
    """The layer's int8 weight [N, K]: its own, or read back from the one copy it keeps: column blocks
    [N / 64, K / 2, 64, 2] (folio.models.int8_blocks), or oneDNN's packed blocks [N / 64, K' / 4, 64, 4]
    (folio.models.onednn_int8), gated or not."""
    if layer.weight is not None:
        return layer.weight
    if getattr(layer, "int8_blocks", None) is not None:
        codes = layer.int8_blocks.codes
        plain = codes.view(codes.shape[0], codes.shape[1], 64, 2).permute(0, 2, 1, 3).reshape(codes.shape[0] * 64, -1)
        return plain[:layer.output_size]
    blocks = layer.onednn_weight.blocks
    plain = blocks.permute(0, 2, 1, 3).reshape(blocks.shape[0] * blocks.shape[2], -1)
    plain = plain[:layer.output_size, :layer.input_size]
    if layer.onednn_weight.silu_table is not None:  # a gated gate/up: its rows interleaved, gates first again
        order = gated_layout.interleave_gated(torch.arange(layer.output_size))
        plain = plain[order.argsort()]
    return plain
