"""KV cache groups for sliding-window layers: blocks wholly out of a sliding layer's window are freed while a
request runs, prefix caching stays correct (a prefix is a hit only where each sliding group still has its
window's blocks), and a long request holds about what its full-attention layers need.

The random-workload test runs the real scheduler and KV cache manager on a full group and two sliding ones
(tests/kv_workload.py): every key each query reads (its window, or its whole context) must hold the token it
should, so a block freed too early and handed to another request, or a wrong cache hit, shows up.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import hf_greedy
from fake_runner import fake_runner_output
from kv_workload import run_random_workload
from folio import LLM, LLMEngine, SamplingParams
from folio.config import SchedulerOptions
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request
from folio.core.scheduler import Scheduler
from folio.models.model_config import ModelConfig
from folio.worker.kv_cache import KVCacheGroup, group_layers


def gemma3_windows(num_layers: int, window: int) -> list:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_grouping():
    groups, size = group_layers(gemma3_windows(26, 512), 26)  # Gemma 3 1B: 4 global layers, 22 local ones
    assert size == 4 and [g.window for g in groups] == [None] + [512] * 6
    assert groups[0].layers == (5, 11, 17, 23) and groups[-1].layers == (24, 25)  # two spare slots
    assert sorted(i for g in groups for i in g.layers) == list(range(26))
    groups, size = group_layers([8, None] * 13, 26)  # Gemma 2: alternating
    assert size == 13 and [(g.window, len(g.layers)) for g in groups] == [(None, 13), (8, 13)]
    assert group_layers((), 30) == ((KVCacheGroup(None, tuple(range(30))),), 30)  # no sliding layers
    assert group_layers([4096] * 32, 32) == ((KVCacheGroup(4096, tuple(range(32))),), 32)  # Mistral
    groups, size = group_layers([None] * 5 + [16] * 6, 11)  # within 25%: the larger count, one group each
    assert size == 6 and [len(g.layers) for g in groups] == [5, 6]


def _fits(windows, block_size, chunk, num_blocks, length) -> bool:
    return sum(KVCacheGroup(w, ()).max_blocks(length, block_size, chunk) for w in windows) <= num_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 10), st.booleans()),
                min_size=1, max_size=10),
       st.integers(10, 40), st.sampled_from([2, 4]), st.integers(3, 24), st.sampled_from([1, 3, 5, 8]),
       st.booleans(), st.integers(0, 10_000))
def test_windows_hold_the_right_tokens_under_random_workloads(reqs, num_blocks, block_size, budget, window,
                                                               caching, seed):
    windows = [None, window, window]  # a full group and two sliding ones, as a Gemma's
    kv = KVCacheManager(num_blocks, block_size, caching, windows)
    max_model_len = 60
    while not _fits(windows, block_size, budget, num_blocks, max_model_len):
        max_model_len -= 1
    sched = Scheduler(SchedulerOptions(max_num_batched_tokens=budget, max_num_seqs=5), kv, max_model_len)
    run_random_workload(sched, reqs, random.Random(seed), max_prefix_len=16, rare_tokens=[0, 3])


def held_blocks_of_a_long_request(windows: list, num_tokens: int, block_size: int = 16, budget: int = 2048,
                                  decode: int = 16) -> tuple[int, int]:
    """(most blocks held at once, blocks held at the end) by one request of num_tokens prompt tokens and
    `decode` generated ones, through the scheduler, in a cache of the given groups."""
    kv = KVCacheManager(1 << 20, block_size, True, windows)
    sched = Scheduler(SchedulerOptions(max_num_batched_tokens=budget, max_num_seqs=4), kv, num_tokens + decode + 1)
    sched.add_request(Request("r", list(range(num_tokens)), SamplingParams(max_tokens=decode, ignore_eos=True),
                              eos_token_ids=frozenset({-1})))
    peak = held = 0
    while sched.num_unfinished:
        out = sched.schedule()
        held = kv.num_held_blocks("r")
        peak = max(peak, held)
        sched.update_from_output(out, fake_runner_output(sched, out, 7))
    return peak, held


@pytest.mark.parametrize("name,layers,window", [("gemma-3-1b", 26, 512), ("gemma-3-4b", 34, 1024),
                                                ("gemma-3-12b", 48, 1024), ("gemma-3-27b", 62, 1024)])
def test_a_16k_request_holds_about_a_sixth(name, layers, window):
    # Gemma 3's layout (five local layers to one global), blocks of 16 tokens, 2048-token prefill chunks.
    groups, size = group_layers(gemma3_windows(layers, window), layers)
    peak, held = held_blocks_of_a_long_request([g.window for g in groups], 16384)
    full = -(-(16384 + 16) // 16) * layers / size  # a full-attention cache, in blocks of `size` layers
    globals_ = sum(1 for g in groups if g.window is None)
    locals_ = len(groups) - globals_
    expected = globals_ * -(-(16384 + 16) // 16) + locals_ * (window // 16 + 1)
    print(f"{name}: {held} blocks of {size} layers held at the end ({peak} at the peak) against {full:.0f} "
          f"for full attention: {held / full:.1%}")
    assert expected - locals_ <= held <= expected
    assert held / full < 1 / 6 + locals_ * (window / 16 + 1) / full + 0.01


@pytest.mark.parametrize("k", [0, 3], ids=["alone", "beside-a-draft-model"])
def test_engine_frees_out_of_window_blocks(tmp_path, k, steps_cost_the_prior):
    # the tiny Gemma 3 (window 8, five local layers to one global): a long request's held blocks grow with the
    # global layer only, and greedy output is Transformers'. Beside a draft model too (the target itself, k guesses
    # a step): it uses the global group's tables, so its global layer's KV is the target's at the same blocks
    from test_gemma import build_gemma

    folder = build_gemma(str(tmp_path / "g3"), "gemma3")
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": k} if k else None
    engine = LLMEngine.from_kwargs(folder, dtype="float32", kv_cache_memory=1 << 22, block_size=4,
                                   max_num_batched_tokens=32, speculative_config=spec)
    kv = engine.kv_cache_manager
    assert kv.windows == [None] + [8] * 5
    prompt = [(7 * i) % 500 + 3 for i in range(150)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30))
    held, tokens, checked = [], None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if kv.req_to_blocks[0].get("r"):
            computed = engine.scheduler.requests["r"].num_computed_tokens
            held.append((computed, kv.num_held_blocks("r")))
            if k:
                checked = max(checked, _assert_draft_kv_is_the_targets(engine, "r", computed, layer=5))
    assert tokens == hf_greedy(folder, prompt, 30)
    computed, blocks = held[-1]
    # the global group holds every block; each local one its window (8 tokens: 3 blocks of 4) and the next, and
    # with drafts the step's guesses and the lookahead slots past them
    assert blocks <= -(-(computed + 1 + 2 * k) // 4) + 5 * (-(-(8 + 2 * k) // 4) + 2)
    assert kv.num_free_blocks == kv.pool.num_blocks
    if k:
        stats = engine.get_stats().spec_decoding
        assert stats.num_draft_tokens > 10 and stats.acceptance_rate == 1.0
        assert checked * 4 >= len(prompt)


def _assert_draft_kv_is_the_targets(engine: LLMEngine, request_id: str, computed: int, layer: int) -> int:
    """A draft model with the target's weights: the K/V of its layer `layer` (a global one) in the blocks of the
    target's full-attention group (group 0), wherever both computed the request's tokens, equal the target's there.
    Returns how many blocks it compared."""
    proposer = engine.runner.speculator.proposer
    draft_kv = proposer._kv.get(request_id)
    block_size = engine.kv_cache_manager.block_size
    blocks = engine.kv_cache_manager.block_ids(request_id, group=0)[:min(computed, draft_kv.valid if draft_kv else 0)
                                                                       // block_size]
    for ours, target in zip(proposer.kv_caches[layer], engine.runner.kv_caches[layer]):
        torch.testing.assert_close(ours[blocks], target[blocks], atol=1e-4, rtol=1e-4)
    return len(blocks)


def test_prefix_cache_with_sliding_windows(tmp_path):
    # prompts sharing a prefix far longer than the window: cache hits, and the same outputs as without the cache
    from test_gemma import build_gemma

    folder = build_gemma(str(tmp_path / "g3"), "gemma3")
    prefix = [(11 * i) % 400 + 5 for i in range(60)]
    prompts = [{"prompt_token_ids": prefix + s} for s in ([1, 2, 3], [9, 8], [4, 4, 4, 4, 4], [300] * 7)]
    params = SamplingParams(temperature=0, max_tokens=12)
    results = []
    for enable in (True, False):
        llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=enable)
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in first + rest])
        if enable:
            assert all(o.num_cached_tokens >= 56 for o in rest)
    assert results[0] == results[1] == [hf_greedy(folder, p["prompt_token_ids"], 12) for p in prompts]


def test_speculative_decoding_with_sliding_windows(tmp_path):
    # ngram drafts: rejected ones roll the computed count back, never before a freed window. A draft model (a random
    # Gemma 2 of the same vocabulary: windows of its own, many wrong guesses) reads the tables of the target's global
    # group, so the local groups stay. Prompts past the window, chunked, with preemptions forced: the outputs are
    # those without speculation (Transformers')
    from test_gemma import PROMPTS, build_gemma, tight_cache_memory

    folder = build_gemma(str(tmp_path / "g3"), "gemma3")
    draft = build_gemma(str(tmp_path / "g2"), "gemma2", seed=1)
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    prompts = [[5, 6, 7, 8, 9] * 6] + PROMPTS
    max_model_len = 64
    expected = [hf_greedy(folder, p, 24)[:max_model_len - len(p)] for p in prompts]
    for spec, draft_layers in (({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3}, 0),
                               ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3}, 4)):
        memory = tight_cache_memory(cfg, max_model_len + 4, 4, 16, draft_layers=draft_layers)
        llm = LLM(folder, dtype="float32", kv_cache_memory=memory, block_size=4, max_num_batched_tokens=16,
                  max_model_len=max_model_len, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.llm_engine.kv_cache_manager.windows == [None] + [8] * 5
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert llm.llm_engine.scheduler.spec_decoding_stats.snapshot().num_draft_tokens > 0


def test_a_draft_model_beside_layers_that_all_slide_keeps_one_group(tmp_path, steps_cost_the_prior):
    # Mistral's layers all slide: no group holds a whole context for the draft model's catch-ups to read, so beside
    # one the cache keeps a single group of every layer (windows still apply)
    from conftest import build_tiny_model

    folder = build_tiny_model(str(tmp_path / "mistral-w8"), "mistral", sliding_window=8)
    engine = dict(dtype="float32", kv_cache_memory=1 << 22, block_size=4, max_num_batched_tokens=7)
    assert LLM(folder, **engine).llm_engine.kv_cache_manager.windows == [8]
    llm = LLM(folder, speculative_config={"method": "draft_model", "model": folder, "num_speculative_tokens": 3},
              **engine)
    assert llm.llm_engine.kv_cache_manager.windows == [None]
    prompt = list(range(20, 61))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(folder, prompt, 24)
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 10 and stats.acceptance_rate == 1.0
