"""LFM2: greedy outputs and logprobs equal Transformers' (float32) on a tiny random checkpoint of convolution and
attention layers, with chunked prefill (a request's convolution state carried from chunk to chunk), preemption
forced (its state recomputed with its KV), requests of a batch decoding while others prefill, and over two
tensor-parallel ranks.

The recurrent states follow each request's own tokens, so the engine runs such a model without prefix caching and
refuses speculative decoding (folio.models.recurrent_state).
"""

from __future__ import annotations

import pytest
import torch

from conftest import EOS_ID, VOCAB, hf_greedy_logprobs, write_tokenizer
from folio import LLM, SamplingParams
from folio.models.model_config import ModelConfig
from folio.worker.kv_cache import KVCacheSpec
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_tensor_parallel import GREEDY, _assert_same, _run

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2, [7, 8, 9]]
MAX_TOKENS = 24
LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, attention layers, kv heads, head_dim, fp32 bytes, block_size
STATE_BYTES = 3 * 64 * 2 * 4  # a request's states: conv layers, channels, conv_L_cache - 1, fp32 bytes


def build_lfm2(folder: str) -> str:
    import transformers

    cfg = transformers.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=2, layer_types=LAYER_TYPES,
                                  block_multiple_of=16, block_ffn_dim_multiplier=1.25, max_position_embeddings=512,
                                  initializer_range=0.2, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory) -> str:
    return build_lfm2(str(tmp_path_factory.mktemp("lfm2")))


@pytest.fixture(scope="module")
def expected(lfm2_dir) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_logprobs(lfm2_dir, p, MAX_TOKENS) for p in PROMPTS]


def test_greedy_matches_transformers(lfm2_dir):
    assert_greedy_matches(lfm2_dir, KV_BLOCK, prompts=PROMPTS, state_bytes=STATE_BYTES)


def test_logprobs_match_transformers(lfm2_dir, expected):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(lfm2_dir, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_only_attention_layers_keep_kv(lfm2_dir):
    import json

    cfg = ModelConfig.from_hf_dict(json.load(open(f"{lfm2_dir}/config.json")))
    assert cfg.recurrent_layers == (0, 2, 3) and cfg.kv_cache_layers == (1, 4)
    assert cfg.intermediate_size == 160  # Lfm2MLP's: 2/3 of 192, times 1.25, to a multiple of 16
    assert KVCacheSpec.for_model(cfg, 16, torch.float32).num_layers == 2


def test_prefix_caching_is_off_and_rows_are_reused(lfm2_dir, expected):
    llm = LLM(lfm2_dir, dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=2)
    assert not llm.llm_engine.kv_cache_manager.enable_prefix_caching
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for _ in range(2):  # the same prompts again: new requests in the rows of the old ones, from zeroed states
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [tokens for tokens, _ in expected]


def test_parallel_samples_each_run_their_own_state(lfm2_dir, expected):
    llm = LLM(lfm2_dir, dtype="float32", kv_cache_memory=1 << 22)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    assert [list(c.token_ids) for c in out.outputs] == [expected[0][0]] * 3


def test_speculative_decoding_is_refused(lfm2_dir):
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(lfm2_dir, dtype="float32", kv_cache_memory=1 << 22,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_two_ranks_give_one_ranks_greedy_tokens(lfm2_dir):
    _assert_same(_run(lfm2_dir, GREEDY, 1, prompts=PROMPTS), _run(lfm2_dir, GREEDY, 2, prompts=PROMPTS))
