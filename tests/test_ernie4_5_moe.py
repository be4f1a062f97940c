"""ERNIE 4.5 MoE: greedy outputs and logprobs equal Transformers' (float32) on a tiny random model (conftest's
"ernie4_5_moe": layers 1 and 3 sparse, two shared experts, routers with a correction bias), with chunked prefill and
preemption forced, the experts fused and one by one; over two tensor-parallel ranks; and from a GGUF file of
llama.cpp's "ernie4_5-moe" architecture.

The correction bias changes most routing choices of the tiny model: the same weights without it must give other
logprobs, so the match shows that it loads and routes. The router stays float32 in a bf16 model, as Transformers keeps
it, from a Hugging Face folder and from a GGUF file alike.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model, hf_greedy_logprobs
from folio.loader.gguf_loader import read_gguf
from folio.loader.model_loader import load_model
from folio.models import fused_moe
from folio.models.ernie4_5_moe import Ernie4_5MoeBlock
from folio.models.llama import LlamaMLP
from folio.models.model_config import ModelConfig
from folio.models.registry import build_model
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 4 * 2 * 32 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 32
SPARSE_LAYERS = (1, 3)
BIAS = "model.layers.{}.mlp.moe_statics.e_score_correction_bias"
EXPERTS_PATHS = pytest.mark.parametrize("fused", [True, False], ids=["fused", "one-by-one"])


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("ernie4_5_moe")), "ernie4_5_moe")


@pytest.fixture(scope="module")
def ernie_gguf(ernie_dir, tmp_path_factory) -> str:
    return hf_to_gguf(ernie_dir, str(tmp_path_factory.mktemp("gguf") / "ernie4_5_moe.gguf"), "ernie4_5-moe")


@pytest.fixture(scope="module")
def expected(ernie_dir) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_logprobs(ernie_dir, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture
def experts_path(monkeypatch, fused: bool) -> list[bool]:
    """Every sparse layer's experts run fused (where fused_moe.supports says they can) or one by one, as `fused`
    says; the list fills with each layer's choice."""
    if fused and fused_moe.KERNEL.load() is None:
        pytest.skip("the fused MoE kernel does not build here")
    supports, chosen = fused_moe.supports, []

    def choose(layers) -> bool:
        chosen.append(fused and supports(layers))
        return chosen[-1]

    monkeypatch.setattr(fused_moe, "supports", choose)
    return chosen


def _logprobs_match(folder: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens and len(set(tokens)) > 3  # a continuation, not one token repeated
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@EXPERTS_PATHS
def test_greedy_matches_transformers(ernie_dir, experts_path, fused):
    assert_greedy_matches(ernie_dir, KV_BLOCK)
    assert experts_path and set(experts_path) == {fused}


@EXPERTS_PATHS
def test_logprobs_match_transformers(ernie_dir, expected, experts_path, fused):
    _logprobs_match(ernie_dir, expected)
    assert experts_path == [fused] * len(SPARSE_LAYERS)


def test_correction_bias_matters(ernie_dir, expected, tmp_path):
    folder = shutil.copytree(ernie_dir, tmp_path / "unbiased")
    tensors = load_file(folder / "model.safetensors")
    for layer in SPARSE_LAYERS:
        tensors[BIAS.format(layer)] = torch.zeros_like(tensors[BIAS.format(layer)])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(str(folder), PROMPTS, MAX_TOKENS), expected):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_norm_min_floors_the_weights_sum(ernie_dir, expected, tmp_path):
    """moe_norm_min above every sum of two routing probabilities: the weights are divided by it, not by their sum,
    in Transformers and in folio, which then give other logprobs than without the floor."""
    folder = shutil.copytree(ernie_dir, tmp_path / "floored")
    cfg = json.load(open(folder / "config.json"))
    json.dump({**cfg, "moe_norm_min": 1.5}, open(folder / "config.json", "w"))
    floored = [hf_greedy_logprobs(str(folder), p, 8) for p in PROMPTS]
    for (tokens, logprobs), (hf_tokens, hf_logprobs), (_, unfloored) in zip(
            greedy_logprobs(str(folder), PROMPTS, 8), floored, expected):
        assert tokens == hf_tokens and logprobs == pytest.approx(hf_logprobs, abs=1e-4)
        assert hf_logprobs[:4] != pytest.approx(unfloored[:4], abs=1e-3)


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_router_stays_float32(ernie_dir, ernie_gguf):
    """In a bf16 model, the router's weight and bias hold the checkpoint's float32 values, not bf16 roundings."""
    tensors = load_file(f"{ernie_dir}/model.safetensors")
    for source in (ernie_dir, ernie_gguf):
        model = load_model(source, torch.bfloat16, 64).model
        for layer in SPARSE_LAYERS:
            gate = model.layers[layer].mlp.gate
            assert torch.equal(gate.weight, tensors[f"model.layers.{layer}.mlp.gate.weight"])
            assert torch.equal(gate.e_score_correction_bias, tensors[BIAS.format(layer)])
        assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("layers,start,end,interval", [(4, 1, -1, 2), (5, 0, 3, 1), (6, 2, 4, 1), (7, 1, 5, 3)])
def test_sparse_layers_are_transformers(layers, start, end, interval):
    """moe_layer_start_index, moe_layer_end_index (-1: the last layer) and moe_layer_interval pick the same sparse
    layers as Transformers' decoder layers."""
    hf = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=layers, num_attention_heads=2,
              num_key_value_heads=1, moe_num_experts=2, moe_k=1, moe_intermediate_size=4, moe_layer_start_index=start,
              moe_layer_end_index=end, moe_layer_interval=interval)
    config = transformers.Ernie4_5_MoeConfig(**hf)
    module = transformers.models.ernie4_5_moe.modeling_ernie4_5_moe
    want = [isinstance(module.Ernie4_5_MoeDecoderLayer(config, i).mlp, module.Ernie4_5_MoeSparseMoeBlock)
            for i in range(layers)]
    model = build_model(ModelConfig.from_hf_dict({"architectures": ["Ernie4_5_MoeForCausalLM"], **hf}), 16)
    assert [isinstance(layer.mlp, Ernie4_5MoeBlock) for layer in model.layers] == want
    assert all(isinstance(layer.mlp, LlamaMLP) for layer, sparse in zip(model.layers, want) if not sparse)
    assert True in want and False in want


def test_config_defaults_and_refusals():
    base = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 3, "num_attention_heads": 4}
    cfg = ModelConfig.from_hf_dict(base)  # Transformers' Ernie4_5_MoeConfig: ERNIE-4.5-21B-A3B's experts, tied
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (64, 6, 1536,
                                                                                                       2 * 1536)
    assert [moe.is_sparse(i) for i in range(3)] == [False, True, True] and cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="use_bias"):
        build_model(ModelConfig.from_hf_dict({**base, "use_bias": True}), 16)
    with pytest.raises(ValueError, match="no moe_num_experts"):
        build_model(ModelConfig.from_hf_dict({**base, "moe_num_experts": 0}), 16)


def test_multi_token_prediction_layers_are_not_served():
    """The released checkpoints hold a multi-token-prediction block (model.mtp_*), which Transformers skips."""
    model = build_model(ModelConfig.from_hf_dict({
        "architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "moe_num_experts": 2, "moe_k": 1,
        "moe_intermediate_size": 4}), 16)
    for name in ("model.mtp_block.0.mlp.gate_proj.weight", "model.mtp_emb_norm.0.weight",
                 "model.mtp_linear_proj.0.weight"):
        assert model.map_checkpoint_name(name) is None
    assert model.map_checkpoint_name(BIAS.format(1)) == ("layers.1.mlp.gate.e_score_correction_bias", None)


def test_two_ranks_give_one_ranks_greedy_tokens(ernie_dir):
    _assert_same(_run(ernie_dir, GREEDY, 1), _run(ernie_dir, GREEDY, 2))


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_gguf_generates_like_transformers(ernie_gguf, expected):
    """llama.cpp's "ernie4_5-moe": the first sparse layer as the leading dense block count, the interval as the MoE
    layer step, the shared experts as ffn_*_shexp, the correction bias as exp_probs_b (squeezed)."""
    assert read_gguf(ernie_gguf).hf_config["architectures"] == ["Ernie4_5_MoeForCausalLM"]
    _logprobs_match(ernie_gguf, expected)
