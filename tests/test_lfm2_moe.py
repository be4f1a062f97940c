"""LFM2-MoE: greedy outputs and logprobs equal Transformers' (float32) on tiny random checkpoints of convolution and
attention layers, a dense first layer and sparse ones after it, with chunked prefill and preemption forced, and over
two tensor-parallel ranks.

Two routers: LFM2-8B-A1B's (sigmoid scores, an expert_bias that chooses, weights renormalised, unscaled), whose bias
is large enough that dropping it changes the logprobs, and one without bias nor renormalisation, scaled by 1.5.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EOS_ID, VOCAB, hf_greedy_logprobs, write_tokenizer
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_lfm2 import KV_BLOCK, LAYER_TYPES, MAX_TOKENS, PROMPTS, STATE_BYTES
from test_tensor_parallel import GREEDY, _assert_same, _run

ROUTERS = {"lfm2-8b-a1b": dict(use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0),
           "unbiased-scaled": dict(use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.5)}


def build_lfm2_moe(folder: str, router: str = "lfm2-8b-a1b") -> str:
    import transformers

    cfg = transformers.Lfm2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                     num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                     layer_types=LAYER_TYPES, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                                     max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
                                     eos_token_id=EOS_ID, pad_token_id=0, **ROUTERS[router])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for layer in model.model.layers:
        if getattr(layer.feed_forward, "use_expert_bias", False):  # Transformers starts it at zero
            layer.feed_forward.expert_bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {router: build_lfm2_moe(str(tmp_path_factory.mktemp(router)), router) for router in ROUTERS}


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {router: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for router, folder in folders.items()}


def test_config(folders):
    hf = json.load(open(f"{folders['lfm2-8b-a1b']}/config.json"))
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.recurrent_layers == (0, 2, 3) and cfg.kv_cache_layers == (1, 4)
    assert cfg.intermediate_size == 128 and cfg.moe.mlp_only_layers == (0,) and cfg.moe.intermediate_size == 32
    assert (cfg.hf_config["topk_method"], cfg.hf_config["scoring_func"]) == ("noaux_tc", "sigmoid")
    with pytest.raises(ValueError, match="'layer_types'"):  # Lfm2MoeConfig has no fallback for them
        ModelConfig.from_hf_dict({k: v for k, v in hf.items() if k != "layer_types"})


def test_greedy_matches_transformers(folders):
    assert_greedy_matches(folders["lfm2-8b-a1b"], KV_BLOCK, prompts=PROMPTS, state_bytes=STATE_BYTES)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_logprobs_match_transformers(folders, expected, router):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folders[router], PROMPTS, MAX_TOKENS),
                                                            expected[router]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_the_expert_bias_matters(folders, expected, tmp_path):
    unbiased = shutil.copytree(folders["lfm2-8b-a1b"], tmp_path / "unbiased")
    tensors = load_file(f"{unbiased}/model.safetensors")
    tensors = {name: t.zero_() if name.endswith("expert_bias") else t for name, t in tensors.items()}
    save_file(tensors, f"{unbiased}/model.safetensors", metadata={"format": "pt"})
    assert any(logprobs[:4] != pytest.approx(hf[:4], abs=1e-3)
               for (_, logprobs), (_, hf) in zip(greedy_logprobs(str(unbiased), PROMPTS, MAX_TOKENS),
                                                 expected["lfm2-8b-a1b"]))


def test_two_ranks_give_one_ranks_greedy_tokens(folders):
    folder = folders["lfm2-8b-a1b"]
    _assert_same(_run(folder, GREEDY, 1, prompts=PROMPTS), _run(folder, GREEDY, 2, prompts=PROMPTS))
