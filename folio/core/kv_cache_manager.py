"""KVCacheManager: each request's block tables, grown on demand, shared through the prefix cache, and
returned the moment the request ends.

A request has one block table per KV cache group (folio.worker.kv_cache: one group of every layer, or, with
sliding-window layers, groups by window); all draw on one block pool. Block tables are append-only as the
model runner sees them: a block id, once in a request's table, never changes until the request is freed, so
the runner keeps tables across steps and only appends.

Sliding groups hold only what their layers can still read: before each allocation, the blocks that lie
wholly before the window of the request's next query go back to the pool (their table entries stay, never
read again; vLLM's hybrid KV cache). A long request then grows only in its full-attention groups.

With prefix caching, a new request first takes every cached full block of its prompt (`find_cached`),
then `allocate_slots` publishes each block it fills completely, as soon as the block is allocated: a
request admitted later in the same step (a sibling of n > 1 samples) can then share it, because every
layer writes the step's new K/V into the cache before any attention reads it. Each group caches its own
blocks (a group's hash is the block's, tagged with the group). A prefix is a hit as far as every full
group has its blocks and every sliding group the blocks of the window before the first token to compute:
a sliding group's blocks before that window are not needed, and are not taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from folio.core.block_hash import extend_block_hashes
from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.request import Request
from folio.utils.math_utils import cdiv

# The table entry of a sliding group's block that a request does not hold (before its window): never read.
# Its id is a valid one, so tables stay valid indices; it is never freed, cached or counted.
NULL_BLOCK = KVCacheBlock(0, ref_cnt=1 << 60)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


@dataclass
class CacheHit:
    """The cached prefix of a request's prompt: num_blocks blocks, and each group's blocks for it (a sliding
    group's start with NULL_BLOCK where its window does not reach)."""

    num_blocks: int
    blocks: list[list[KVCacheBlock]]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Sequence[Optional[int]] = (None,)) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(group_windows)  # per KV cache group: its sliding window, or None
        self.pool = BlockPool(num_blocks)
        # per group: request id -> its blocks, in table order
        self.req_to_blocks: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.windows]
        # per group: request id -> how many leading blocks are published
        self.num_cached_blocks: list[dict[str, int]] = [{} for _ in self.windows]
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _key(self, group: int, block_hash: bytes) -> bytes:
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block the group's layers still read once num_tokens tokens are computed (the window of
        the query at position num_tokens); 0 for full attention."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def find_cached(self, request: Request) -> CacheHit:
        """The longest prefix of cached blocks that every group can use. The last token is never taken from
        the cache: it must be computed to get the logits of the next one."""
        if not self.enable_prefix_caching or request.needs_every_prompt_position:
            return CacheHit(0, [[] for _ in self.windows])
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        found: list[list[Optional[KVCacheBlock]]] = [[] for _ in self.windows]
        for g, window in enumerate(self.windows):  # full groups: the prefix every one has
            if window is None:
                for block_hash in hashes[:n]:
                    block = self.pool.lookup(self._key(g, block_hash))
                    if block is None:
                        break
                    found[g].append(block)
                n = len(found[g])
        # sliding groups: the longest prefix n whose last window of blocks, before block n, each has
        last_miss = {}  # per sliding group: for each i < n, the last block at or before i it lacks (-1: none)
        for g, window in enumerate(self.windows):
            if window is not None:
                found[g] = [self.pool.lookup(self._key(g, h)) for h in hashes[:n]]
                misses, last = [], -1
                for i, block in enumerate(found[g]):
                    last = i if block is None else last
                    misses.append(last)
                last_miss[g] = misses
        while n > 0 and any(misses[n - 1] >= self._first_needed(g, n * self.block_size)
                            for g, misses in last_miss.items()):
            n -= 1
        blocks = [[NULL_BLOCK] * self._first_needed(g, n * self.block_size) for g in range(self.num_groups)]
        for g, group_blocks in enumerate(blocks):
            group_blocks += found[g][len(group_blocks):n]
        return CacheHit(n, blocks)

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted request's prefix-cache lookup (not the attempts that found no room)."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[CacheHit] = None,
                       num_lookahead_tokens: int = 0) -> Optional[tuple[list[int], ...]]:
        """Make room for `num_new_tokens` tokens after the computed ones and the cache hit, and for
        `num_lookahead_tokens` more that only a draft model writes. Returns, per group, the ids of the blocks
        the request gained (the hits, then new blocks; often none), or None (and nothing taken) if the pool
        is short. A sliding group first gives back its blocks out of the window."""
        rid = request.request_id
        hit_blocks = hit.blocks if hit is not None else [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + (hit.num_blocks * self.block_size if hit is not None else 0)
        total = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        tables = [self.req_to_blocks[g].setdefault(rid, []) for g in range(self.num_groups)]
        for g, blocks in enumerate(tables):
            if self.windows[g] is not None:
                self._free_out_of_window(blocks, self._first_needed(g, num_computed))
        needed = [total - len(blocks) - len(hits) for blocks, hits in zip(tables, hit_blocks)]
        revived = sum(1 for hits in hit_blocks for b in hits if b.ref_cnt == 0)  # hits sitting in the free list
        if sum(max(0, n) for n in needed) + revived > self.pool.num_free_blocks:
            return None
        for hits in hit_blocks:  # every group's hits out of the free list before any group allocates
            for block in hits:
                if block is not NULL_BLOCK:
                    self.pool.touch(block)
        new_ids = []
        for g, (blocks, hits, n) in enumerate(zip(tables, hit_blocks, needed)):
            first_new = len(blocks)
            blocks.extend(hits)
            if n > 0:
                # a sliding group's new blocks before its window (a chunk longer than it) are still written
                blocks.extend(self.pool.allocate(n))
            if self.enable_prefix_caching:
                self._publish_full_blocks(request, g, blocks, min(num_computed + num_new_tokens, request.num_tokens))
            new_ids.append([b.block_id for b in blocks[first_new:]])
        return tuple(new_ids)

    def _free_out_of_window(self, blocks: list[KVCacheBlock], first_needed: int) -> None:
        """Give back the blocks before first_needed, leaving NULL_BLOCK in their table places (newest first,
        as `free` does: the most specific prefix is evicted first). The freed places are always a leading run,
        so the walk back from first_needed stops at the first one: a step's cost does not grow with the context."""
        freed, i = [], min(first_needed, len(blocks)) - 1
        while i >= 0 and blocks[i] is not NULL_BLOCK:
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
            i -= 1
        if freed:
            self.pool.free(freed)

    def _publish_full_blocks(self, request: Request, group: int, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        counts = self.num_cached_blocks[group]
        start = counts.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        for i in range(start, end):
            if blocks[i] is not NULL_BLOCK:
                self.pool.cache(blocks[i], self._key(group, request.block_hashes[i]))
        counts[request.request_id] = end

    def free(self, request: Request) -> None:
        """Return a request's blocks. Tail first, so that among blocks freed together the most specific
        (longest-prefix) ones are evicted first."""
        for g in range(self.num_groups):
            blocks = self.req_to_blocks[g].pop(request.request_id, [])
            self.num_cached_blocks[g].pop(request.request_id, None)
            self.pool.free(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def unpublish_uncomputed(self, request: Request) -> None:
        """Before freeing a request preempted in the step that allocated its blocks: blocks published for
        tokens that will now never be computed must not stay in the cache."""
        for g in range(self.num_groups):
            blocks = self.req_to_blocks[g].get(request.request_id, [])
            for block in blocks[request.num_computed_tokens // self.block_size:]:
                if block is not NULL_BLOCK:
                    self.pool.uncache(block)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.num_cached_blocks = [{rid: len(b) for rid, b in tables.items()}  # never republish
                                  for tables in self.req_to_blocks]

    def block_ids(self, request_id: str, start: int = 0, group: int = 0) -> list[int]:
        """The request's block ids in a group from index `start` on (its block table is append-only while it
        runs; a sliding group's entries before its window are NULL_BLOCK's)."""
        return [b.block_id for b in self.req_to_blocks[group].get(request_id, ())[start:]]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, over every group."""
        return sum(1 for tables in self.req_to_blocks for b in tables.get(request_id, ()) if b is not NULL_BLOCK)
