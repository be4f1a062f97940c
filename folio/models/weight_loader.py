"""Parameters that a checkpoint fills, and the per-parameter loaders that fill them.

Weights always come from a checkpoint, so parameters are created uninitialised (instant, no random init).

The checkpoint loop (folio.loader.weights) does not know how a parameter keeps its data: it hands each
checkpoint tensor to the parameter's `weight_loader(param, tensor, shard_id)`, with the shard id the model's
name mapping gives (None for a whole tensor). So a fused q/k/v layer puts each shard into its rows, and a
quantised or tensor-parallel layer could keep its own form or slice of the tensor, without the model or the
loop knowing. A parameter's `shard_ids` lists the shards it needs, so the loop can name any never loaded.
Parameters without these attributes take one whole tensor (`default_weight_loader`).

A loader rejects a tensor by raising ValueError with a message that completes "checkpoint tensor NAME ...",
e.g. "has shape (3, 4), expected (2, 4)": only the loop knows the tensor's name, and it prefixes it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Union

import torch
from torch import nn

ShardId = Union[str, int, None]
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# The shard id of a checkpoint tensor that holds all of a fused parameter's shards, stacked along its first dim
# in declaration order (Phi-3's qkv_proj and gate_up_proj). The loading loop splits it (`shard_slices`) and
# hands each piece to the weight loader as that shard, so every loader handles shards only.
ALL_SHARDS = "<all shards>"


def uninitialized(*shape: int, dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def copy_checked(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
    if shard_id is not None:
        raise ValueError(f"is given as shard {shard_id!r} of a parameter that has no shards")
    copy_checked(param.data, tensor)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader, shard_ids: Iterable[ShardId]) -> None:
    """shard_ids: the shards the parameter needs; a mapping {shard id: (first, count)} also says where each
    lies along the first dim, so that a tensor of them all can be split (`ALL_SHARDS`)."""
    param.weight_loader = loader
    param.shard_ids = tuple(shard_ids)
    if isinstance(shard_ids, Mapping):
        param.shard_extents = dict(shard_ids)


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def shard_ids_of(param: nn.Parameter) -> tuple[ShardId, ...]:
    return getattr(param, "shard_ids", (None,))


def shard_slices(param: nn.Parameter, tensor: torch.Tensor) -> list[tuple[ShardId, torch.Tensor]]:
    """A tensor of all the parameter's shards cut into (shard id, its rows)."""
    extents = getattr(param, "shard_extents", None)
    if not extents:
        raise ValueError("holds fused shards, but its parameter has none")
    total = sum(count for _, count in extents.values())
    if tensor.shape[0] != total:
        raise ValueError(f"has {tensor.shape[0]} rows, expected {total} (the fused shards {list(extents)})")
    return [(shard_id, tensor[first:first + count]) for shard_id, (first, count) in extents.items()]


def keep_bf16_tensors(param: nn.Parameter, unless: Callable[[nn.Parameter], bool] = lambda p: False) -> None:
    """Make a float32 parameter's loader keep bf16 checkpoint tensors in bf16 (every bf16 value is a float32 one,
    so a float32 copy would hold the same values in twice the bytes): the parameter turns bf16 at its first tensor
    if that one is bf16, and back to float32 (exactly) at any later one that is not. `unless(param)`, asked at
    each tensor, leaves the dtype alone (an embedding table a tied lm_head shares: the head's method decides)."""
    load = weight_loader_of(param)

    def load_keeping_bf16(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
        if unless(p):
            pass
        elif not getattr(p, "bf16_decided", False):
            p.bf16_decided = True
            if tensor.dtype == torch.bfloat16:
                p.data = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
        elif p.dtype == torch.bfloat16 and tensor.dtype != torch.bfloat16:
            p.data = p.data.to(torch.float32)
        load(p, tensor, shard_id)

    param.weight_loader = load_keeping_bf16
