"""Prefix caching: shared prefixes computed once, LRU eviction, salts, and identical outputs on and off."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from conftest import hf_greedy
from kv_workload import run_random_workload
from folio import LLM, SamplingParams
from folio.config import SchedulerOptions
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request
from folio.core.scheduler import Scheduler

PREFIX = list(range(30, 70))  # 40 tokens: two and a half blocks of 16
SUFFIXES = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [300, 301, 302, 303, 304, 305]]


def _llm(folder, **kw):
    return LLM(folder, dtype="float32", kv_cache_memory=1 << 22, **kw)


def _count_model_tokens(llm) -> list[int]:
    """Wrap the model runner so each step's number of computed tokens is recorded."""
    runner, counts = llm.llm_engine.runner, []
    execute = runner.execute

    def counting(sched):
        counts.append(sched.num_tokens)
        return execute(sched)

    runner.execute = counting
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=16, n=2)])
def test_outputs_identical_with_caching_on_and_off(llama_dir, params):
    prompts = [{"prompt_token_ids": PREFIX + s} for s in SUFFIXES]
    results = []
    for enable in (True, False):
        llm = _llm(llama_dir, enable_prefix_caching=enable)
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # warms the cache
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        results.append([[c.token_ids for c in o.outputs] for o in first + rest])
    assert results[0] == results[1]
    if params.temperature == 0:
        assert [r[0] for r in results[0]] == [hf_greedy(llama_dir, p["prompt_token_ids"], 16) for p in prompts]


def test_second_request_computes_only_new_tokens(llama_dir):
    llm = _llm(llama_dir)
    counts = _count_model_tokens(llm)
    params = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate({"prompt_token_ids": PREFIX + SUFFIXES[0]}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and sum(counts) == 43
    counts.clear()
    second = llm.generate({"prompt_token_ids": PREFIX + SUFFIXES[1]}, params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32  # two full blocks of 16; the unit of reuse is the block
    assert sum(counts) == 42 - 32
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 32 and stats.prefix_cache_queries == 43 + 42
    llm.reset_prefix_cache()
    counts.clear()
    third = llm.generate({"prompt_token_ids": PREFIX + SUFFIXES[1]}, params, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0 and sum(counts) == 42


def test_short_prefix_does_not_hit(llama_dir):
    llm = _llm(llama_dir)
    llm.generate({"prompt_token_ids": [1, 2, 3, 4, 5]}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4, 6]}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_cache_salt_isolates_tenants(llama_dir):
    llm = _llm(llama_dir)
    params = SamplingParams(max_tokens=1)
    llm.generate({"prompt_token_ids": PREFIX + [1], "cache_salt": "alice"}, params, use_tqdm=False)
    bob = llm.generate({"prompt_token_ids": PREFIX + [2], "cache_salt": "bob"}, params, use_tqdm=False)[0]
    alice = llm.generate({"prompt_token_ids": PREFIX + [3], "cache_salt": "alice"}, params, use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": PREFIX + [4]}, params, use_tqdm=False)[0]
    assert (bob.num_cached_tokens, alice.num_cached_tokens, plain.num_cached_tokens) == (0, 32, 0)


def test_n_samples_share_the_prompt(llama_dir):
    def peak_blocks(enable: bool) -> tuple[int, int]:
        llm = _llm(llama_dir, enable_prefix_caching=enable)
        engine, counts = llm.llm_engine, _count_model_tokens(llm)
        engine.add_request("r", {"prompt_token_ids": PREFIX * 2}, SamplingParams(n=4, max_tokens=4))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_cache_manager.pool.num_blocks - engine.kv_cache_manager.num_free_blocks)
        return peak, sum(counts)

    (shared_blocks, shared_tokens), (separate_blocks, separate_tokens) = peak_blocks(True), peak_blocks(False)
    assert shared_blocks < separate_blocks
    # 80-token prompt: the first sample computes it all, the others only the last partial block's tokens
    assert shared_tokens == 80 + 3 * (80 - 64) + 4 * 3
    assert separate_tokens == 4 * 80 + 4 * 3


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=2)

    def request(rid, tokens):
        return Request(rid, tokens, SamplingParams(max_tokens=1))

    a, b = request("a", [1, 2, 3, 4, 5]), request("b", [7, 8, 9, 10, 11])
    (a_ids,), (b_ids,) = kv.allocate_slots(a, 5), kv.allocate_slots(b, 5)  # the ids of the blocks each gained
    assert a_ids == kv.block_ids("a") and b_ids == kv.block_ids("b") and len(a_ids) == 3
    kv.free(a)
    kv.free(b)
    # never-hashed partial blocks first (most recently freed at the very front), then cached blocks
    # least-recently freed first, each request's tail block before its head
    assert kv.pool.free_queue.block_ids() == [b_ids[2], a_ids[2], a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    c = request("c", [1, 2, 3, 4, 99])  # hits a's two full blocks and revives them from the free list
    hits = kv.find_cached(c)
    assert hits.num_blocks == 2 and [blk.block_id for blk in hits.blocks[0]] == a_ids[:2]
    assert kv.allocate_slots(c, 1, hits) == (kv.block_ids("c"),)  # the hits, then one new block
    assert kv.block_ids("c")[:2] == a_ids[:2] and kv.allocate_slots(c, 0) == ([],)
    d = request("d", [50, 51, 52, 53, 54, 55])  # 3 blocks: the remaining partial first, then b's, evicting them
    assert kv.allocate_slots(d, 6) == (kv.block_ids("d"),) == ([a_ids[2], b_ids[1], b_ids[0]],)
    assert kv.pool.lookup(b.block_hashes[1]) is None and kv.pool.lookup(b.block_hashes[0]) is None
    assert kv.pool.lookup(a.block_hashes[0]) is not None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 8), st.booleans()),
                min_size=1, max_size=10),
       st.integers(8, 30), st.sampled_from([2, 4]), st.integers(4, 40), st.integers(0, 10_000))
def test_prefix_cache_invariants_under_random_workloads(reqs, num_blocks, block_size, budget, seed):
    max_model_len = min(num_blocks * block_size, 48)
    cfg = SchedulerOptions(max_num_batched_tokens=budget, max_num_seqs=5)
    sched = Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len)
    run_random_workload(sched, reqs, random.Random(seed), max_prefix_len=12, rare_tokens=[0, 3, 4])
    pool = sched.kv_cache_manager.pool
    assert len(pool.allocate(num_blocks)) == num_blocks  # every block reusable, cached or not
    assert not pool.cached


def test_preempted_request_resumes_from_its_cached_blocks(llama_dir):
    per_block = 2 * 2 * 2 * 16 * 4 * 4
    llm = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=12 * per_block, max_model_len=48)
    counts = _count_model_tokens(llm)
    prompts = [{"prompt_token_ids": list(range(10 * i + 3, 10 * i + 23))} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    recomputed = sum(counts) - sum(20 + 20 for _ in prompts)
    assert recomputed >= 0
    # without the cache every preemption would recompute the whole request; with it, far less is redone
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p["prompt_token_ids"], 20)[:28]
                                                     for p in prompts]
    assert engine.kv_cache_manager.prefix_stats.hits > 0


def test_beam_search_equals_transformers_num_beams(llama_dir):
    from conftest import _hf_model
    from folio import BeamSearchParams

    llm = _llm(llama_dir)
    counts = _count_model_tokens(llm)
    prompts = [PREFIX + [5, 6, 7], [100, 101, 102, 103]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    hf = _hf_model(llama_dir)
    for prompt, out in zip(prompts, outs):
        import torch

        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, num_beams=3, do_sample=False,
                          num_return_sequences=3, eos_token_id=None, pad_token_id=0, early_stopping=True)
        assert [s.tokens for s in out.sequences] == [r[len(prompt):].tolist() for r in ref]
    # beams share their prompt's blocks: far fewer tokens computed than 3 beams x 8 steps x whole prompt
    assert sum(counts) < 3 * 8 * len(prompts[0])
