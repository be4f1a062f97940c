"""Greedy outputs equal Transformers' token for token, whatever the batching, chunking or preemption."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_logprobs
from folio import LLM, LLMEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17],
           [300] * 9, list(range(400, 426))]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _expected(folder: str) -> list[list[int]]:
    return [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
                                      ("qwen2", True), ("qwen3", False)])
def test_greedy_matches_transformers(tiny_model_factory, arch, tie):
    folder = tiny_model_factory(arch, tie)
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outputs) == _expected(folder)
    for out in outputs:
        reason = out.outputs[0].finish_reason
        assert reason == ("stop" if out.outputs[0].token_ids[-1] == 2 else "length")


@pytest.fixture(params=["cpu_paged", "torch_sdpa"])
def attention_backend(request, monkeypatch):
    """Run a test with each attention backend (the fast kernel is the default when it builds)."""
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", request.param)
    return request.param


def test_chunked_prefill_matches(llama_dir, attention_backend):
    # a budget of 7 tokens splits every long prompt into chunks and mixes them with other requests' decodes
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outputs) == _expected(llama_dir)


def test_preemption_matches(llama_dir, attention_backend):
    # 12 blocks of 4 tokens: far too few for all six requests at once, so the scheduler must preempt
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
    llm = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=12 * per_block, max_model_len=48)
    engine = llm.llm_engine
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS)[:48 - len(p)] for p in PROMPTS]
    assert _tokens(outputs) == expected
    assert engine.kv_cache_manager.num_free_blocks == 12


def test_requests_added_while_others_decode(llama_dir, attention_backend):
    engine = LLMEngine.from_kwargs(llama_dir, dtype="float32", kv_cache_memory=1 << 22)
    results = {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, prompt = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(PROMPTS))] == _expected(llama_dir)


def test_logprobs_close_to_transformers(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22)
    prompt = PROMPTS[3]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                                     prompt_logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(llama_dir, prompt + completion.token_ids)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top-1
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
            assert lp.rank == int((row > row[tid]).sum()) + 1
        assert entry[token].rank == 1
    assert completion.cumulative_logprob == pytest.approx(
        sum(ref[len(prompt) - 1 + i][t].item() for i, t in enumerate(completion.token_ids)), abs=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1][prompt[pos]].item(), abs=1e-4)


def test_prompt_logprobs_with_chunked_prefill(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=5)
    prompt = PROMPTS[2]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ref = hf_logprobs(llama_dir, prompt)
    got = [e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None]
    want = [ref[i - 1][prompt[i]].item() for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)


def test_bf16_runs_and_mostly_agrees(llama_dir):
    llm = LLM(llama_dir, dtype="bfloat16", kv_cache_memory=1 << 22)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    expected = _expected(llama_dir)[0]
    assert len(out.outputs[0].token_ids) > 0
    # bf16 rounding may flip a near-tie late in the sequence; the first tokens must agree
    assert out.outputs[0].token_ids[:3] == expected[:3]
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.bfloat16


def test_prompt_logprobs_once_with_n_samples_and_preemption(llama_dir):
    per_block = 2 * 2 * 2 * 16 * 4 * 4
    llm = LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=12 * per_block, max_model_len=48,
              max_num_batched_tokens=8)
    prompt = PROMPTS[2][:30]
    ref = hf_logprobs(llama_dir, prompt)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2,
                        SamplingParams(n=2, max_tokens=12, prompt_logprobs=1, temperature=1.0, seed=3), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for out in outs:
        assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs) == 2
        got = [e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None]
        assert got == pytest.approx([ref[i - 1][prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_greedy_steps_take_the_heads_argmax_and_others_the_logits(llama_dir, dtype):
    """A step whose every request is plain greedy asks the model for its tokens (the head's method may skip the
    logits: bf16 on AMX from 9 rows), and they are the logits' argmax; a step with a request that wants more
    (logprobs here) computes the logits."""
    from folio.sample.sampling_ops import argmax_rows

    llm = LLM(llama_dir, dtype=dtype, kv_cache_memory=1 << 24)
    model = llm.llm_engine.runner.model
    calls = {"compute_greedy_tokens": 0, "compute_logits": 0}

    def counted(name: str, real):
        def call(hidden: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return real(hidden)
        return call

    for name in calls:
        setattr(model, name, counted(name, getattr(model, name)))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(5 + i)]} for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fused = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert calls == {"compute_greedy_tokens": 8, "compute_logits": 0}  # one step of 12 prompts, then 7 decodes
    model.compute_greedy_tokens = lambda hidden: argmax_rows(model.compute_logits(hidden))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == fused

    model.compute_greedy_tokens = counted("compute_greedy_tokens", argmax_rows)  # must not be called
    calls.update(compute_greedy_tokens=0, compute_logits=0)
    wants_logprobs = [params] * 11 + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)]
    assert _tokens(llm.generate(prompts, wants_logprobs, use_tqdm=False)) == fused
    assert calls == {"compute_greedy_tokens": 0, "compute_logits": 8}
