"""Fill a model's parameters from checkpoint tensors (safetensors and GGUF both arrive as (Hugging Face
name, tensor) pairs).

The model only maps names (`map_checkpoint_name`: checkpoint name -> parameter name and shard id, or None
to skip); each parameter's weight loader decides how the tensor is stored (folio.models.weight_loader).
Every parameter, and every shard of a fused one, must come from the checkpoint: a tensor with no place or
the wrong shape, and a parameter or shard never given, is a ValueError naming it. A model whose checkpoints hold
several parameters' tensors in one (Granite MoE stacks its experts') cuts each into named pieces first, by its
`split_checkpoint_tensor(name, tensor)`; the pieces are then mapped and loaded as checkpoint tensors.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from folio.models.weight_loader import ALL_SHARDS, ShardId, shard_ids_of, shard_slices, weight_loader_of


def _split(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each cut by the model's split_checkpoint_tensor where it has one."""
    split = getattr(model, "split_checkpoint_tensor", None)
    return iter(tensors) if split is None else (piece for name, tensor in tensors for piece in split(name, tensor))


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, ShardId]] = set()
    for name, tensor in _split(model, tensors):
        target = model.map_checkpoint_name(name)
        if target is None:
            continue
        param_name, shard_id = target
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        try:
            pieces = shard_slices(param, tensor) if shard_id == ALL_SHARDS else [(shard_id, tensor)]
            for piece_id, piece in pieces:
                weight_loader_of(param)(param, piece, piece_id)
                loaded.add((param_name, piece_id))
        except ValueError as e:  # the loader's message completes this sentence (see weight_loader)
            raise ValueError(f"checkpoint tensor {name!r} {e}") from None
    missing = [name if shard_id is None else f"{name} (shard {shard_id!r})"
               for name, param in params.items() for shard_id in shard_ids_of(param)
               if (name, shard_id) not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
