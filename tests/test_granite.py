"""Granite 3.x: greedy outputs and logprobs equal Transformers' (float32) on tiny random models whose four scalars are
far from 1, with chunked prefill and preemption forced, and over two tensor-parallel ranks.

Two variants: logits divided by 3 (not a power of two: greedy decoding takes the argmax of the divided logits) and
by 8 with a tied lm_head (the head's own argmax). Each scalar must change what folio computes when it is set to 1
in the config, or the match with Transformers would not show that folio applies it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import build_tiny_model, hf_greedy_logprobs
from folio.models.granite import GraniteForCausalLM
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
MAX_TOKENS = 24
SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
VARIANTS = {"granite": {}, "granite-tied-pow2": {"tie": True, "logits_scaling": 8.0}}


@pytest.fixture(scope="module")
def granite_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: build_tiny_model(str(tmp_path_factory.mktemp(name)), "granite", **overrides)
            for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def expected(granite_dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in granite_dirs.items()}


def _logprobs(folder: str) -> list[tuple[list[int], list[float]]]:
    return greedy_logprobs(folder, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(granite_dirs, name):
    assert_greedy_matches(granite_dirs[name], KV_BLOCK)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logprobs_match_transformers(granite_dirs, expected, name):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(_logprobs(granite_dirs[name]), expected[name]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize("scalar", SCALARS)
def test_each_scalar_matters(granite_dirs, expected, scalar, tmp_path):
    folder = shutil.copytree(granite_dirs["granite"], tmp_path / scalar)
    cfg = json.load(open(folder / "config.json"))
    cfg[scalar] = 1.0
    json.dump(cfg, open(folder / "config.json", "w"))
    for (_, logprobs), (_, hf_logprobs) in zip(_logprobs(str(folder)), expected["granite"]):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_scalars_from_the_config():
    base = {"architectures": ["GraniteForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1}
    model = GraniteForCausalLM(ModelConfig.from_hf_dict(base), 16)  # Transformers' defaults: all 1
    assert (model.embedding_multiplier, model.logits_scaling, model.exact_scaling) == (1.0, 1.0, True)
    layer = model.layers[0]
    assert layer.self_attn.attn_params.scale == 1.0 and layer.mlp.residual_multiplier == 1.0
    assert not GraniteForCausalLM(ModelConfig.from_hf_dict({**base, "logits_scaling": 10.0}), 16).exact_scaling
    with pytest.raises(ValueError, match="logits_scaling must be positive, got 0.0"):
        GraniteForCausalLM(ModelConfig.from_hf_dict({**base, "logits_scaling": 0}), 16)


def test_two_ranks_give_one_ranks_greedy_tokens(granite_dirs):
    folder = granite_dirs["granite"]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))
