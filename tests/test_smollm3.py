"""SmolLM3: greedy outputs and logprobs equal Transformers' (float32) on a tiny random model whose layers 1 and 3 use
no RoPE, with chunked prefill and preemption forced, and over two tensor-parallel ranks.

RoPE barely moves a tiny random model's argmax, so the logprobs are compared too, over prompts and outputs of
dozens of positions; and the same weights read as Llama (RoPE in every layer) must give other logprobs, or the
test could not tell a NoPE layer from a rotated one.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import build_tiny_model, hf_greedy_logprobs
from folio import LLM
from folio.models.model_config import ModelConfig
from folio.models.smollm3 import NoRotary, rope_layers
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 4 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
LONG_PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("smollm3")), "smollm3")


@pytest.fixture(scope="module")
def expected(smollm3_dir) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_logprobs(smollm3_dir, p, MAX_TOKENS) for p in LONG_PROMPTS]


def _logprobs(folder: str) -> list[tuple[list[int], list[float]]]:
    return greedy_logprobs(folder, LONG_PROMPTS, MAX_TOKENS)


def test_greedy_matches_transformers(smollm3_dir):
    assert_greedy_matches(smollm3_dir, KV_BLOCK)


def test_logprobs_match_transformers(smollm3_dir, expected):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(_logprobs(smollm3_dir), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_nope_layers_matter(smollm3_dir, expected, tmp_path):
    llm = LLM(smollm3_dir, dtype="float32", kv_cache_memory=1 << 22)
    layers = llm.llm_engine.runner.model.layers
    assert [isinstance(layer.self_attn.rotary, NoRotary) for layer in layers] == [False, True, False, True]
    as_llama = shutil.copytree(smollm3_dir, tmp_path / "as-llama")
    cfg = json.load(open(as_llama / "config.json"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(as_llama / "config.json", "w"))
    for (_, logprobs), (_, hf_logprobs) in zip(_logprobs(str(as_llama)), expected):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_rope_layers_from_the_config():
    # Transformers' SmolLM3Config: without the list, every no_rope_layer_interval-th layer is NoPE (default 4)
    assert rope_layers({}, 8) == [True, True, True, False] * 2
    assert rope_layers({"no_rope_layer_interval": 2}, 4) == [True, False, True, False]
    assert rope_layers({"no_rope_layers": [0, 1, 1], "no_rope_layer_interval": 2}, 3) == [False, True, True]
    with pytest.raises(ValueError, match="no_rope_layers lists 3 layers, the model has 4"):
        rope_layers({"no_rope_layers": [1, 1, 0]}, 4)


def test_sliding_window_on_nope_layers(tmp_path):
    # use_sliding_window: Transformers' SmolLM3Config makes the NoPE layers the sliding ones (8 tokens, far shorter
    # than the prompts)
    folder = build_tiny_model(str(tmp_path / "swa"), "smollm3", no_rope_layers=None, no_rope_layer_interval=2,
                              use_sliding_window=True, sliding_window=8)
    assert ModelConfig.from_hf_dict(json.load(open(f"{folder}/config.json"))).sliding_windows == (None, 8, None, 8)
    expected = [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in LONG_PROMPTS]
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(_logprobs(folder), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_two_ranks_give_one_ranks_greedy_tokens(smollm3_dir):
    _assert_same(_run(smollm3_dir, GREEDY, 1), _run(smollm3_dir, GREEDY, 2))
