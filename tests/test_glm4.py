"""GLM and GLM-4: greedy outputs and logprobs equal Transformers' (float32) on tiny random models, with chunked prefill
and preemption forced, over two tensor-parallel ranks, and from llama.cpp-style GGUF files.

What sets GLM apart must each be seen to matter: the rotary embedding turns interleaved pairs of half of each head
(read as neox halves, or over whole heads, the same weights give other logprobs); the q/k/v biases and the norms'
weights, which Transformers initialises to 0 and 1, are randomised, so a bias or a GLM-4 sandwich norm that did not
load would show.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.glm4 import modeling_glm4

from conftest import build_tiny_model, hf_greedy, hf_greedy_logprobs
from folio import LLM, SamplingParams
from folio.loader.gguf_tokenizer import _PRE_TOKENIZERS
from folio.models import glm4
from folio.models.layers import InterleavedRotaryEmbedding, RotaryEmbedding
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import PROMPTS as GGUF_PROMPTS, hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
MAX_TOKENS = 24
ARCHS = ("glm", "glm4")


def _randomise_biases_and_norms(folder: str) -> str:
    path = os.path.join(folder, "model.safetensors")
    tensors, gen = load_file(path), torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            t.normal_(0, 0.2, generator=gen)
        elif name.endswith("norm.weight"):
            t.add_(torch.randn(t.shape, generator=gen), alpha=0.2)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: _randomise_biases_and_norms(build_tiny_model(str(tmp_path_factory.mktemp(arch)), arch))
            for arch in ARCHS}


@pytest.fixture(scope="module")
def expected(glm_dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {arch: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for arch, folder in glm_dirs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(glm_dirs, arch):
    assert_greedy_matches(glm_dirs[arch], KV_BLOCK)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(glm_dirs, expected, arch):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(glm_dirs[arch], PROMPTS, MAX_TOKENS),
                                                            expected[arch]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def _neox_rotary(monkeypatch, folder):
    monkeypatch.setattr(glm4.GlmForCausalLM, "rotary_cls", RotaryEmbedding)
    return folder


def _whole_heads_rotating(monkeypatch, folder):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.mark.parametrize("misreading", [_neox_rotary, _whole_heads_rotating])
def test_the_rotary_embedding_matters(glm_dirs, expected, misreading, monkeypatch, tmp_path):
    folder = misreading(monkeypatch, str(shutil.copytree(glm_dirs["glm4"], tmp_path / "glm4")))
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected["glm4"]):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_interleaved_rotary_equals_transformers(dtype, factor):
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 9
    config = transformers.Glm4Config(head_dim=head_dim, num_attention_heads=heads, max_position_embeddings=64,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                      "partial_rotary_factor": factor})
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 30, 31, 62, 63])
    cos, sin = modeling_glm4.Glm4RotaryEmbedding(config)(qkv, positions[None])
    q, k = qkv[:, :heads].transpose(0, 1)[None], qkv[:, heads:heads + kv_heads].transpose(0, 1)[None]
    want_q, want_k = modeling_glm4.apply_rotary_pos_emb(q, k, cos, sin)

    rotary = InterleavedRotaryEmbedding(head_dim, 64, 500.0, None, rotary_dim=int(head_dim * factor))
    got_q, got_k = rotary(positions, *qkv.clone().split_with_sizes([heads, kv_heads, kv_heads], 1)[:2])
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    neox = RotaryEmbedding(head_dim, 64, 500.0, None, rotary_dim=int(head_dim * factor))
    neox_q, _ = neox(positions, *qkv.clone().split_with_sizes([heads, kv_heads, kv_heads], 1)[:2])
    assert not torch.equal(neox_q, got_q)


def test_transformers_defaults_where_the_config_is_silent():
    base = {"architectures": ["Glm4ForCausalLM"], "vocab_size": 8, "hidden_size": 32, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16}
    attention = glm4.Glm4ForCausalLM(ModelConfig.from_hf_dict(base), 16).layers[0].self_attn
    assert attention.qkv_proj.with_bias and attention.rotary.rotary_dim == 8  # q/k/v biases, half of each head
    stated = {**base, "attention_bias": False, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}
    attention = glm4.Glm4ForCausalLM(ModelConfig.from_hf_dict(stated), 16).layers[0].self_attn
    assert not attention.qkv_proj.with_bias and attention.rotary.rotary_dim == 4
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        glm4.GlmForCausalLM(ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"}), 16)


def test_two_ranks_give_one_ranks_greedy_tokens(glm_dirs):
    folder = glm_dirs["glm4"]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


def _fuse_qkv(folder: str, into: str) -> str:
    """A copy of a GLM folder whose q/k/v are one tensor per layer, as ChatGLM's checkpoints keep them."""
    os.makedirs(into)
    shutil.copy(os.path.join(folder, "config.json"), into)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [tensors.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        tensors[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    save_file(tensors, os.path.join(into, "model.safetensors"))
    return into


@pytest.mark.usefixtures("isolated_gguf_cache")
@pytest.mark.parametrize("arch, gguf_arch", [("glm4", "glm4"), ("glm", "chatglm")])
def test_gguf_generates_like_transformers(glm_dirs, tmp_path, arch, gguf_arch):
    """GLM-4's files keep q/k/v apart; ChatGLM's (glm-4-9b-chat) fuse them, which GLM's weights load from too."""
    folder = glm_dirs[arch]
    source = _fuse_qkv(folder, str(tmp_path / "fused")) if gguf_arch == "chatglm" else folder
    llm = LLM(hf_to_gguf(source, str(tmp_path / "glm.gguf"), gguf_arch), dtype="float32", kv_cache_memory=1 << 22,
              max_num_batched_tokens=7)
    assert llm.llm_engine.model_config.architecture == ("Glm4ForCausalLM" if arch == "glm4" else "GlmForCausalLM")
    outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 16) for p in GGUF_PROMPTS]


@pytest.mark.parametrize("pre", ["glm4", "chatglm-bpe"])
def test_gguf_pre_tokenizer_splits_digits_in_threes(pre):
    # llama.cpp's CHATGLM4 split (Llama 3's regex), where GPT-2's, the fallback for unknown names, keeps "12345" whole
    pieces = [piece for piece, _ in _PRE_TOKENIZERS[pre]().pre_tokenize_str("ab 12345")]
    assert pieces == ["ab", "Ġ", "123", "45"]
