"""EXAONE 4.0: greedy outputs and logprobs equal Transformers' (float32) on tiny random models, with chunked prefill
and preemption forced, over two tensor-parallel ranks, and from a GGUF file of llama.cpp's "exaone4" architecture.

The hybrid model (32B's layout) has an 8-token window on layers 0-2, which rotate q and k, and a global layer 3
with no positional encoding; prompts and outputs run to dozens of positions. Giving layer 3 RoPE must change the
logprobs, or the test could not tell a NoPE layer from a rotated one. The global model (1.2B's layout: no
sliding_window) rotates every layer.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import build_tiny_model, hf_greedy_logprobs
from folio.loader.gguf_loader import read_gguf
from folio.models import exaone4
from folio.models.model_config import ModelConfig
from folio.models.smollm3 import NoRotary
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 4 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 32
VARIANTS = {"hybrid": {}, "global": {"sliding_window": None, "layer_types": ["full_attention"] * 4, "tie": True}}


@pytest.fixture(scope="module")
def exaone_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: build_tiny_model(str(tmp_path_factory.mktemp(f"exaone4-{name}")), "exaone4", **overrides)
            for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def expected(exaone_dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in exaone_dirs.items()}


def _assert_logprobs_match(folder: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_greedy_matches_transformers(exaone_dirs):
    folder = exaone_dirs["hybrid"]
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    assert cfg.sliding_windows == (8, 8, 8, None)
    assert_greedy_matches(folder, KV_BLOCK)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logprobs_match_transformers(exaone_dirs, expected, name):
    _assert_logprobs_match(exaone_dirs[name], expected[name])


def test_nope_layer_matters(exaone_dirs, expected, monkeypatch):
    from folio import LLM

    layers = LLM(exaone_dirs["hybrid"], dtype="float32", kv_cache_memory=1 << 22).llm_engine.runner.model.layers
    assert [isinstance(layer.self_attn.rotary, NoRotary) for layer in layers] == [False, False, False, True]
    monkeypatch.setattr(exaone4, "rope_layers", lambda cfg: [True] * cfg.num_hidden_layers)
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(exaone_dirs["hybrid"], PROMPTS, MAX_TOKENS),
                                               expected["hybrid"]):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_layer_types_and_rope_from_the_config():
    base = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 8, "num_attention_heads": 1, "max_position_embeddings": 8192}
    # Transformers' Exaone4Config: a window of 4096 on three layers of every four (sliding_window_pattern 4)
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.sliding_windows == (4096, 4096, 4096, None) * 2
    assert exaone4.rope_layers(cfg) == [True, True, True, False] * 2
    # the released 32B's form of the pattern (beside layer_types): a letter a layer, L local, G global
    cfg = ModelConfig.from_hf_dict({**base, "sliding_window_pattern": "LLGG"})
    assert cfg.sliding_windows == (4096, 4096, None, None) * 2
    # no window (1.2B): every layer global and rotated
    cfg = ModelConfig.from_hf_dict({**base, "sliding_window": None, "layer_types": ["full_attention"] * 8})
    assert cfg.sliding_windows == () and exaone4.rope_layers(cfg) == [True] * 8
    # a window no shorter than the context attends to everything: the sliding layers still rotate, as Transformers'
    cfg = ModelConfig.from_hf_dict({**base, "sliding_window": 8192})
    assert cfg.sliding_windows == () and exaone4.rope_layers(cfg) == [True, True, True, False] * 2


def test_two_ranks_give_one_ranks_greedy_tokens(exaone_dirs):
    folder = exaone_dirs["hybrid"]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


@pytest.mark.usefixtures("isolated_gguf_cache")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gguf_generates_like_transformers(exaone_dirs, expected, name, tmp_path):
    path = hf_to_gguf(exaone_dirs[name], str(tmp_path / f"exaone4-{name}.gguf"), "exaone4")
    ours = ModelConfig.from_hf_dict(read_gguf(path).hf_config)
    theirs = ModelConfig.from_hf_dict(json.load(open(os.path.join(exaone_dirs[name], "config.json"))))
    assert (ours.architecture, ours.sliding_windows, exaone4.rope_layers(ours)) == \
        (theirs.architecture, theirs.sliding_windows, exaone4.rope_layers(theirs))
    _assert_logprobs_match(path, expected[name])
