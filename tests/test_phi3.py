"""Phi-3 / Phi-3.5 / Phi-4-mini: greedy outputs equal Transformers' (fused qkv and gate_up checkpoints, partial
rotary, LongRoPE past the original context, the sliding window), with chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model
from folio import LLM
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
HALF = 8
VARIANTS = {
    "phi3": {},
    # Phi-4-mini: three quarters of each head rotates; tied embeddings
    "phi4-mini": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                  "tie_word_embeddings": True},
    # Phi-3.5: LongRoPE (short factors and the attention factor) within the original context. Past it, Transformers'
    # Phi-3 generate recomputes the whole cache with the long factors, which folio does not (folio.models.rope_scaling)
    "phi3.5-longrope": {"max_position_embeddings": 192, "original_max_position_embeddings": 48,
                        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                                            "long_factor": [1.5 + 2.0 * i for i in range(HALF)]}},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3_dir(request, tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp(request.param)), "phi3", **VARIANTS[request.param])


def test_greedy_matches_transformers(phi3_dir):
    assert_greedy_matches(phi3_dir, KV_BLOCK)


def test_sliding_window_matches_transformers(tmp_path):
    # Phi-3's own sliding_window (Phi-3-mini-4k: 2047) on every layer, as Transformers' Phi-3 masks it: prompts
    # longer than the window, in chunks and through preemptions, with the layers' old blocks freed
    folder = build_tiny_model(str(tmp_path / "phi3-w8"), "phi3", sliding_window=8)
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 20)
    assert llm.llm_engine.model_config.sliding_windows == (8, 8)
    assert llm.llm_engine.kv_cache_manager.windows == [8]
    assert_greedy_matches(folder, KV_BLOCK)


def test_a_window_no_shorter_than_the_context_is_full_attention():
    # Phi-3-mini-4k slides (2047 of 4096); Phi-3.5-mini's window (262144) exceeds its context (131072): it hides no
    # key, so its layers run as full attention
    phi = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 2, "num_attention_heads": 1}
    mini_4k = ModelConfig.from_hf_dict({**phi, "sliding_window": 2047, "max_position_embeddings": 4096})
    assert mini_4k.sliding_windows == (2047, 2047)
    mini_3_5 = ModelConfig.from_hf_dict({**phi, "sliding_window": 262144, "max_position_embeddings": 131072})
    assert mini_3_5.sliding_windows == () and mini_3_5.sliding_window(0) is None


def test_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    folder = build_tiny_model(str(tmp_path / "bad"), "phi3")
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}' has 112 rows, expected 128"):
        LLM(folder, dtype="float32", kv_cache_memory=1 << 20)
