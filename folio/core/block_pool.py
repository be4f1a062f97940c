"""BlockPool: the fixed set of KV cache blocks, their reference counts and the free list.

KV memory is preallocated once and split into blocks of `block_size` tokens. A block is owned by as many
requests as its reference count says; it returns to the free list the moment that count reaches zero.
The free list is an intrusive doubly-linked list threaded through the block objects themselves, so
popping, appending and removing a block from the middle are all O(1) with no allocation: the latter is
what prefix caching needs to revive a freed block that still holds a useful prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    prev_free: Optional["KVCacheBlock"] = None
    next_free: Optional["KVCacheBlock"] = None


class FreeBlockQueue:
    """Doubly-linked list of free blocks; allocation takes from the front, frees go to the back."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV cache block")  # callers check num_free first
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Front-to-back ids (for tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def share(self, block: KVCacheBlock) -> None:
        """Take one more reference to a block (a second owner of the same KV)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the order given; blocks nobody holds become free."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
