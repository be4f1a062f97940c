"""ERNIE 4.5 (dense): greedy outputs and logprobs equal Transformers' (float32) on a tiny random model whose head_dim
(32) is not hidden_size / heads (16), with chunked prefill and preemption forced, over two tensor-parallel ranks, and
from a GGUF file of llama.cpp's "ernie4_5" architecture.

RoPE barely moves a tiny random model's argmax, so logprobs are compared over prompts and outputs of dozens of
positions; the same weights read as Llama (RoPE on the halves of each head, not on interleaved pairs) must give other
logprobs, or the test could not tell the two layouts apart.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import build_tiny_model, hf_greedy_logprobs
from folio import LLM
from folio.loader.gguf_loader import read_gguf
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 2 * 2 * 32 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("ernie4_5")), "ernie4_5", tie=True)


@pytest.fixture(scope="module")
def expected(ernie_dir) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_logprobs(ernie_dir, p, MAX_TOKENS) for p in PROMPTS]


def _assert_logprobs_match(folder: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_greedy_matches_transformers(ernie_dir):
    assert_greedy_matches(ernie_dir, KV_BLOCK)


def test_logprobs_match_transformers(ernie_dir, expected):
    _assert_logprobs_match(ernie_dir, expected)


def test_interleaved_rope_matters(ernie_dir, expected, tmp_path):
    as_llama = shutil.copytree(ernie_dir, tmp_path / "as-llama")
    cfg = json.load(open(as_llama / "config.json"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(as_llama / "config.json", "w"))
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(str(as_llama), PROMPTS, MAX_TOKENS), expected):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_config_defaults_and_refusals(ernie_dir):
    base = {"architectures": ["Ernie4_5ForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    cfg = ModelConfig.from_hf_dict(base)  # Transformers' Ernie4_5Config: head_dim 128, lm_head tied
    assert cfg.head_dim == 128 and cfg.tie_word_embeddings
    folder = shutil.copytree(ernie_dir, ernie_dir + "-bias")
    hf = json.load(open(f"{folder}/config.json"))
    json.dump({**hf, "use_bias": True}, open(f"{folder}/config.json", "w"))
    with pytest.raises(ValueError, match="use_bias"):
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22)


def test_two_ranks_give_one_ranks_greedy_tokens(ernie_dir):
    _assert_same(_run(ernie_dir, GREEDY, 1), _run(ernie_dir, GREEDY, 2))


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_gguf_generates_like_transformers(ernie_dir, expected, tmp_path):
    # llama.cpp's converter keeps ERNIE's Q and K rows as they are (its "normal" RoPE rotates interleaved pairs)
    path = hf_to_gguf(ernie_dir, str(tmp_path / "ernie4_5.gguf"), "ernie4_5")
    assert read_gguf(path).hf_config["architectures"] == ["Ernie4_5ForCausalLM"]
    _assert_logprobs_match(path, expected)
