"""Bad input gets a clear ValueError naming what is wrong, and the engine keeps serving other requests."""

from __future__ import annotations

import os

import pytest

from folio import LLM, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine.from_kwargs(llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,match", [
    ("", "empty"), ({"prompt_token_ids": []}, "empty"), ({"prompt_token_ids": list(range(64))}, "max_model_len"),
    ({"prompt_token_ids": [1, 99999]}, "vocabulary"), ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    (42, "prompt"),
])
def test_bad_prompts_rejected_and_engine_keeps_serving(engine, prompt, match):
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["good"] and len(outputs[0].outputs[0].token_ids) == 4
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_blocks


def test_bad_request_level_params(engine):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", "hi", SamplingParams(logit_bias={100000: 1.0}))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("y", "hi", SamplingParams(logprobs=100))
    engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()


def test_generate_with_one_bad_prompt_leaves_nothing_behind(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(["fine"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_unknown_model_path_and_architecture(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100000)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    from folio.loader.default_model import default_model_path

    src = default_model_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(src) // 3))
    with pytest.raises(ValueError, match="cut.gguf"):
        LLM(str(cut))


def test_request_too_long_for_the_whole_cache_is_rejected(llama_dir):
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # K/V, layers, kv heads, head_dim, fp32 bytes, block_size
    engine = LLMEngine.from_kwargs(llama_dir, dtype="float32", kv_cache_memory=3 * per_block)
    assert engine.max_model_len == 48  # lowered to what the cache can hold
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": list(range(60))})
