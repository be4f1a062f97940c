"""An int8 layer's weight for tests, wherever the layer keeps it."""

from __future__ import annotations

import torch

from folio.models.linear import Linear


def int8_weight(layer: Linear) -> torch.Tensor:
    """The layer's int8 weight [N, K]: its own, or, where it keeps only oneDNN's packed copy
    (folio.models.onednn_int8), read back from that copy's blocks [N / 64, K' / 4, 64, 4]."""
    if layer.weight is not None:
        return layer.weight
    blocks = layer.onednn_weight.blocks
    plain = blocks.permute(0, 2, 1, 3).reshape(blocks.shape[0] * blocks.shape[2], -1)
    return plain[:layer.output_size, :layer.input_size]
