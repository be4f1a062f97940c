"""Check a tiny model's greedy outputs against Transformers' with chunked prefill and with preemption forced, and
folio's greedy tokens and their logprobs (chunked prefill, 4-token blocks) to compare with Transformers'."""

from __future__ import annotations

from conftest import hf_greedy
from folio import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 41)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 17],
           [300] * 9]


def _tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_greedy_matches(folder: str, kv_block_bytes: int, max_tokens: int = 24, max_model_len: int = 48,
                          prompts: list[list[int]] = PROMPTS, state_bytes: int = 0) -> None:
    """kv_block_bytes: one 4-token block's K and V over all layers in float32, to size a cache of 12 blocks:
    too few for every request at once, so the scheduler must preempt. state_bytes: a hybrid model's recurrent
    states of one request in float32, which the budget holds for each prompt besides the blocks."""
    expected = [hf_greedy(folder, p, max_tokens) for p in prompts]
    chunked = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    assert _tokens(chunked, prompts, max_tokens) == expected
    preempted = LLM(folder, dtype="float32", block_size=4, max_num_seqs=len(prompts),
                    kv_cache_memory=12 * kv_block_bytes + len(prompts) * state_bytes, max_model_len=max_model_len)
    assert _tokens(preempted, prompts, max_tokens) == [e[:max_model_len - len(p)] for p, e in zip(prompts, expected)]
    assert preempted.llm_engine.scheduler.num_preemptions > 0


def greedy_logprobs(folder: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs from folio (float32, chunks of 7 tokens, 4-token blocks), as
    conftest.hf_greedy_logprobs gives Transformers'."""
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7, block_size=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]
