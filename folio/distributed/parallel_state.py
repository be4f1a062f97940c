"""The tensor-parallel group of this process: which rank it is, how many ranks share each layer, and their
collectives.

A worker process joins the group (`init_tensor_parallel`) before it builds its model, through torch.distributed
with the platform's backend (gloo on CPUs). Parallel linear layers (folio.models.linear) read the group as they
are built: each rank keeps its slice of their weights, and a row-parallel layer sums the ranks' partial
products with `all_reduce`; a vocabulary-parallel lm_head (folio.models.vocab_parallel) gathers the ranks'
logits with `all_gather`. A process that joined no group is rank 0 of 1, and every layer is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from folio.distributed import shm_all_reduce


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: Optional[dist.ProcessGroup] = None
    shared_memory: Optional[shm_all_reduce.SharedMemoryAllReduce] = None  # ranks on one machine: sums through shared memory

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place; every rank gets the same values, so the ranks' next steps,
        sampling included, agree."""
        if self.shared_memory is not None and self.shared_memory.fits(x):
            return self.shared_memory(x)
        if self.size > 1:
            dist.all_reduce(x, group=self.group)  # a rank's reduced piece is copied to the others
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (each the same shape), concatenated along dim in rank order: a vocabulary-parallel
        lm_head's logits (folio.models.vocab_parallel). x itself on one rank."""
        if self.shared_memory is not None and self.shared_memory.fits(x):
            return self.shared_memory.all_gather(x, dim)
        if self.size == 1:
            return x
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x.contiguous(), group=self.group)
        return torch.cat(pieces, dim=dim)


_SINGLE = TensorParallelGroup(0, 1)
_group = _SINGLE


def tensor_parallel_group() -> TensorParallelGroup:
    return _group


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str) -> None:
    """Join the group of `size` ranks that meets at init_method (tcp://host:port) as `rank`; ranks that meet on
    this machine (127.0.0.1) sum through shared memory."""
    global _group
    if size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        shared = None
        if init_method.startswith("tcp://127.0.0.1:") and shm_all_reduce.available():
            shared = shm_all_reduce.SharedMemoryAllReduce(rank, size, shm_all_reduce.buffer_path(init_method),
                                                          dist.group.WORLD)
        _group = TensorParallelGroup(rank, size, dist.group.WORLD, shared if shared and shared.slot_bytes else None)


def destroy_tensor_parallel() -> None:
    global _group
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = _SINGLE

