"""KVCacheManager: each request's block table, grown on demand, shared through the prefix cache, and
returned the moment the request ends.

Block tables are append-only: a block id, once in a request's table, never changes until the request is
freed, so the model runner can keep tables across steps and only append.

With prefix caching, a new request first takes every cached full block of its prompt (`find_cached`),
then `allocate_slots` publishes each block it fills completely, as soon as the block is allocated: a
request admitted later in the same step (a sibling of n > 1 samples) can then share it, because every
layer writes the step's new K/V into the cache before any attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from folio.core.block_hash import extend_block_hashes
from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.request import Request
from folio.utils.math_utils import cdiv


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: how many leading blocks are published
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts the request's tokens. The last token is never taken
        from the cache: it must be computed to get the logits of the next one."""
        if not self.enable_prefix_caching or request.needs_every_prompt_position:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        hits = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted request's prefix-cache lookup (not the attempts that found no room)."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> Optional[list[int]]:
        """Make room for `num_new_tokens` tokens after the computed ones and the given cache hits, and for
        `num_lookahead_tokens` more that only a draft model writes. Returns the ids of the blocks the request
        gained (the hits, then new blocks; often none), or None (and nothing taken) if the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = (cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size) - len(blocks)
                  - len(cached_blocks))
        revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)  # hits sitting in the free list
        if needed + revived > self.pool.num_free_blocks:
            return None
        for block in cached_blocks:
            self.pool.touch(block)
        first_new = len(blocks)
        blocks.extend(cached_blocks)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        if self.enable_prefix_caching:
            self._publish_full_blocks(request, blocks, min(num_computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in blocks[first_new:]]

    def _publish_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        for i in range(start, end):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Return a request's blocks. Tail first, so that among blocks freed together the most specific
        (longest-prefix) ones are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def unpublish_uncomputed(self, request: Request) -> None:
        """Before freeing a request preempted in the step that allocated its blocks: blocks published for
        tokens that will now never be computed must not stay in the cache."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            self.pool.uncache(block)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.num_cached_blocks = {rid: len(b) for rid, b in self.req_to_blocks.items()}  # never republish

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from index `start` on (its block table is append-only while it runs)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())[start:]]
