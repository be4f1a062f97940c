"""RoPE scaling types: cos/sin tables bit-identical to Transformers' rotary embedding, step by step as its decode
loop calls it, and tiny Llamas of each type generating past their original context as Transformers does."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_model, hf_greedy
from folio import LLM, SamplingParams
from folio.models.layers import RotaryEmbedding
from folio.models.model_config import ModelConfig

ORIGINAL = 24  # the original context of the scaled models; prompts fit it, generations go past it
HALF = 8  # head_dim 16 -> 8 frequencies
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, ORIGINAL),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                     "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, 4 * ORIGINAL),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                  "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                  "long_factor": [1.5 + 2.0 * i for i in range(HALF)]}, 4 * ORIGINAL),
}


def _hf_config(kind: str, theta: float = 10000.0):
    from transformers import LlamaConfig

    scaling, max_len = SCALINGS[kind]
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_len,
                       rope_parameters={**scaling, "rope_theta": theta})


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_tables_equal_transformers_step_by_step(kind):
    """Transformers' rotary embedding called as generate calls it (a prompt, then one position per step) gives
    cos/sin equal to folio's table rows, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = _hf_config(kind)
    positions = 4 * ORIGINAL
    cfg = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = RotaryEmbedding.for_model(cfg, positions, cfg.rope_theta, cfg.rope_scaling)
    hf = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    prompt = ORIGINAL - 4
    cos, sin = hf(x, torch.arange(prompt)[None])
    assert torch.equal(cos[0], ours.cos[:prompt]) and torch.equal(sin[0], ours.sin[:prompt])
    for p in range(prompt, positions):
        cos, sin = hf(x, torch.tensor([[p]]))
        assert torch.equal(cos[0, 0], ours.cos[p]), p
        assert torch.equal(sin[0, 0], ours.sin[p]), p


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})


def test_dynamic_and_linear_stretch_the_context():
    cfg = ModelConfig.from_hf_dict({**_hf_config("dynamic").to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert cfg.max_context == 4 * ORIGINAL
    cfg = ModelConfig.from_hf_dict({**_hf_config("yarn").to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert cfg.max_context == 4 * ORIGINAL


PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 50)), [100, 3, 250, 77, 1, 90, 91]]


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn-mscale", "llama3", "longrope"])
def test_greedy_past_the_original_context_matches_transformers(tmp_path, kind):
    scaling, max_len = SCALINGS[kind]
    folder = build_tiny_model(str(tmp_path / kind), "llama", max_position_embeddings=max_len,
                              rope_parameters={**scaling, "rope_theta": 10000.0})
    max_tokens = 3 * ORIGINAL  # well past the original context
    expected = [hf_greedy(folder, p, max_tokens) for p in PROMPTS]
    assert max(len(p) + len(e) for p, e in zip(PROMPTS, expected)) > 2 * ORIGINAL
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_partial_rotary_rotates_the_leading_channels_only():
    """Phi-4-mini's shape: 96 of 128 channels rotate, through the fused bf16 kernel on views of one qkv tensor."""
    from folio.models import fused_ops

    rot = RotaryEmbedding(128, 256, 10000.0, None, rotary_dim=96)
    qkv = torch.randn(7, (8 + 2 + 2) * 128).to(torch.bfloat16)
    q, k, _ = qkv.split([8 * 128, 2 * 128, 2 * 128], dim=-1)
    q, k = q.view(7, 8, 128), k.view(7, 2, 128)
    positions = torch.tensor([0, 3, 9, 100, 5, 6, 255])
    want_q, want_k = fused_ops.ref_rotary(positions, q[..., :96].clone(), k[..., :96].clone(), rot.cos, rot.sin)
    q0, k0 = q.clone(), k.clone()
    rot(positions, q, k)
    assert torch.equal(q[..., :96], want_q) and torch.equal(k[..., :96], want_k)
    assert torch.equal(q[..., 96:], q0[..., 96:]) and torch.equal(k[..., 96:], k0[..., 96:])
