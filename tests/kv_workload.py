"""A random workload for the scheduler and the KV cache manager, checked after every step: the harness of
test_prefix_caching's and test_hybrid_kv_cache's random-workload tests (one group, or sliding-window groups).

It runs the real scheduler and KV cache manager with a stand-in runner (fake_runner) and writes each step's
tokens into the cache slots of every group's block table, as the forward pass would. After each step's writes
every key each query reads (its window, or its whole context) must hold the token it should, and nothing is
held before a request's windows; after the step's update every block's reference count is the number of
(request, group) places holding it, and a cached block holds what its hash names. A block freed too early and
handed to another request, or a wrong cache hit, shows up as a wrong token.
"""

from __future__ import annotations

import random

from fake_runner import fake_runner_output
from folio import SamplingParams
from folio.core.block_hash import extend_block_hashes
from folio.core.kv_cache_manager import NULL_BLOCK
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler

MAX_STEPS = 3000
ABORT_AT_STEP = 4  # the requests marked to abort are aborted here, mid-run


def run_random_workload(sched: Scheduler, reqs: list[tuple[int, int, int, bool]], rng: random.Random,
                        max_prefix_len: int, rare_tokens: list[int]) -> None:
    """reqs: (which of four random prefixes, extra tokens, max_tokens, abort) per request. A request samples 5,
    or one of rare_tokens (EOS is 0) one time in ten. Runs until every request has finished, then checks that
    every block is free again."""
    kv = sched.kv_cache_manager
    pool, block_size, windows = kv.pool, kv.block_size, kv.windows
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, max_prefix_len))] for _ in range(4)]
    all_requests = []
    for i, (p, extra, max_tokens, abort) in enumerate(reqs):
        tokens = (prefixes[p] + [rng.randrange(1, 50) for _ in range(extra)])[:sched.max_model_len - 1]
        req = Request(str(i), tokens, SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0}))
        sched.add_request(req)
        all_requests.append((req, abort))
    slot_tokens: dict[int, int] = {}  # what each cache slot holds, as the forward pass would write it
    for step in range(MAX_STEPS):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        steps = []
        for item in out.scheduled:  # every layer writes the step's K/V before any attention reads
            r = sched.requests[item.request_id]
            for g in range(len(windows)):  # a scheduled request holds nothing before its windows
                first = kv._first_needed(g, item.num_computed_tokens)
                assert all(b is NULL_BLOCK for b in kv.req_to_blocks[g][item.request_id][:first])
            tables = [kv.block_ids(item.request_id, group=g) for g in range(len(windows))]
            positions = range(item.num_computed_tokens, item.num_computed_tokens + item.num_tokens)
            for table in tables:
                for pos in positions:
                    slot_tokens[table[pos // block_size] * block_size + pos % block_size] = r.all_token_ids[pos]
            steps.append((r, tables, positions))
        for r, tables, positions in steps:  # each query reads its window (or its whole context) in each group
            for table, w in zip(tables, windows):
                for pos in positions:
                    for key in range(0 if w is None else max(0, pos - w + 1), pos + 1):
                        slot = table[key // block_size] * block_size + key % block_size
                        assert slot_tokens.get(slot) == r.all_token_ids[key], "a key holds another token"
        sched.update_from_output(out, fake_runner_output(sched, out, lambda: rng.choice(rare_tokens)
                                                         if rng.random() < 0.1 else 5))
        # reference counts: the (request, group) pairs holding each block; out-of-window places hold none
        holders: dict[int, int] = {}
        for tables in kv.req_to_blocks:
            for blocks in tables.values():
                for b in blocks:
                    if b is not NULL_BLOCK:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(pool.blocks[b].ref_cnt == n for b, n in holders.items())
        assert all(b.ref_cnt == 0 for b in pool.blocks if b.block_id not in holders)
        assert pool.num_free_blocks == pool.num_blocks - len(holders)
        # a cached block holds what its hash names, in the group its key names
        known = {}
        for req, _ in all_requests:
            extend_block_hashes(req.block_hashes, req.all_token_ids, block_size, None)
            for j, h in enumerate(req.block_hashes):
                for g in range(len(windows)):
                    known[kv._key(g, h)] = req.all_token_ids[j * block_size:(j + 1) * block_size]
        for h, blk in pool.cached.items():
            assert blk.block_hash == h
            written = [slot_tokens.get(blk.block_id * block_size + o) for o in range(block_size)]
            assert written == known[h], "a cached block holds other tokens than its hash names"
        if step == ABORT_AT_STEP:
            sched.finish_requests([r.request_id for r, abort in all_requests if abort], RequestStatus.FINISHED_ABORTED)
    assert sched.num_unfinished == 0
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not any(kv.req_to_blocks)
