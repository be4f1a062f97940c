"""BlockPool: the fixed set of KV cache blocks, their reference counts, the free list and the prefix cache.

KV memory is preallocated once and split into blocks of `block_size` tokens. A block is owned by as many
requests as its reference count says; it returns to the free list the moment that count reaches zero.
The free list is an intrusive doubly-linked list threaded through the block objects themselves, so
popping, appending and removing a block from the middle are all O(1) with no allocation.

Prefix cache: a full block can carry a hash of its contents (see block_hash.py); the pool maps hashes to
blocks. A freed block keeps its hash and contents, so a later request with the same prefix can take it
back out of the free list (O(1) removal). Eviction is lazy and least-recently-freed first: a block loses
its hash only when the free list hands it out for new contents. Freed blocks without a hash go to the
front of the free list, so they are reused before any block that still holds a cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None
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
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
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
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks for new contents, evicting the cached prefix each one may still hold."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            self.uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, block: KVCacheBlock) -> None:
        """Take one more reference to a block (a cache hit: another owner of the same KV)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the order given; blocks nobody holds become free."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block's contents under its hash. If another block already holds the same contents
        it stays the cached one; this block simply stays uncached (block tables never change)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight swap, say); blocks in use stay in use, uncached."""
        for block in list(self.cached.values()):
            self.uncache(block)
