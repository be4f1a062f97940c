"""Warm start (folio.worker.warm_up): the engine runs a prefill chunk and a decode of its own before the first
request, leaves nothing of it behind in the runner, the block pool or the prefix cache, and outputs stay
Transformers'."""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from folio import LLM, SamplingParams
from folio.worker.model_runner import ModelRunner
from folio.worker.warm_up import WARM_UP_PROMPT_LEN

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_the_engine_prefills_and_decodes_once_before_the_first_request(llama_dir, monkeypatch):
    steps = []
    execute = ModelRunner.execute

    def recording(self, sched):
        steps.append([(s.num_computed_tokens, s.num_tokens) for s in sched.scheduled])
        return execute(self, sched)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    engine = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22).llm_engine
    assert steps == [[(0, WARM_UP_PROMPT_LEN)], [(WARM_UP_PROMPT_LEN, 1)], []]
    assert not engine.runner.requests and not engine.runner.inputs.rows
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_in_the_blocks_warm_up_wrote_match_transformers(llama_dir, prefix_caching):
    """The first request gets the blocks the warm-up wrote; a repeat of it hits the prefix cache."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, enable_prefix_caching=prefix_caching)
    prompt = list(range(100, 100 + WARM_UP_PROMPT_LEN + 8))
    expected = hf_greedy(llama_dir, prompt, 12)
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected


def test_a_cache_smaller_than_the_warm_up_prompt(llama_dir):
    llm = LLM(llama_dir, dtype="float32", block_size=4, max_model_len=12, kv_cache_memory=3 * 4 * 2 * 2 * 2 * 16 * 4)
    prompt = [5, 6, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(llama_dir, prompt, 4)
