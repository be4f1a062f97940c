"""KVCacheManager: each request's block table, grown on demand and returned the moment it ends.

Block tables are append-only: a block id, once in a request's table, never changes until the request is
freed, so the model runner can keep tables across steps and only append.
"""

from __future__ import annotations

from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of KV; False (and nothing taken) if the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return a request's blocks. Tail first, so the most specific blocks are the first to be reused."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
