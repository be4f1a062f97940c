"""OLMo 2 and OLMo 3: greedy outputs and logprobs equal Transformers' (float32) on tiny random models, with chunked
prefill and preemption forced, over two tensor-parallel ranks, and from llama.cpp-style GGUF files.

The tiny OLMo 3 (tests/conftest.py ARCH_CONFIGS) has a 6-token window on layer 0, shorter than the prompts, with a
RoPE base of its own, and YaRN on the full layer only: reading the same weights without the window, or with the
full layer's RoPE on the sliding one, must give other logprobs, or the match could not show folio applies them. Its
variant with q/k/v/o biases (made non-zero) and a single KV head runs over two ranks: each rank then holds half
of q, so the q norm sums squares across the ranks, and the whole k, whose squares both ranks add. The GGUF files
are written as llama.cpp's converter writes both families (architecture "olmo2"), in float32.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model, hf_greedy_logprobs
from folio.loader.gguf_loader import read_gguf
from folio.models.layers import RMSNorm
from folio.models.model_config import ModelConfig
from folio.models.olmo2 import Olmo2ForCausalLM, Olmo2RMSNorm
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import add_byte_level_tokenizer, write_out
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
LONG_PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 24
# the variant's layer types share a RoPE base, as llama.cpp's OLMo 3 files must: it is also written as a GGUF file
VARIANTS = {"olmo2": ("olmo2", {}), "olmo3": ("olmo3", {}),
            "olmo3-bias-mqa": ("olmo3", {"attention_bias": True, "num_key_value_heads": 1, "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128}}})}


def _with_random_biases(folder: str) -> str:
    """Transformers initialises biases to zero: random ones, so that loading and adding them is tested."""
    path = os.path.join(folder, "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    tensors = {name: t + 0.2 * torch.randn(t.shape, generator=generator) if name.endswith(".bias") else t
               for name, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def olmo_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: _with_random_biases(build_tiny_model(str(tmp_path_factory.mktemp(name)), arch, **overrides))
            for name, (arch, overrides) in VARIANTS.items()}


@pytest.fixture(scope="module")
def expected(olmo_dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in LONG_PROMPTS]
            for name, folder in olmo_dirs.items()}


def _logprobs(folder: str) -> list[tuple[list[int], list[float]]]:
    return greedy_logprobs(folder, LONG_PROMPTS, MAX_TOKENS)


def _assert_matches(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(got, want):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_greedy_matches_transformers(olmo_dirs):
    assert_greedy_matches(olmo_dirs["olmo3"], KV_BLOCK)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logprobs_match_transformers(olmo_dirs, expected, name):
    _assert_matches(_logprobs(olmo_dirs[name]), expected[name])


def _no_window(cfg: dict) -> None:
    cfg["sliding_window"] = None


def _full_rope_everywhere(cfg: dict) -> None:
    cfg["rope_parameters"]["sliding_attention"] = cfg["rope_parameters"]["full_attention"]


@pytest.mark.parametrize("edit", [_no_window, _full_rope_everywhere])
def test_olmo3_window_and_local_rope_matter(olmo_dirs, expected, edit, tmp_path):
    folder = shutil.copytree(olmo_dirs["olmo3"], tmp_path / "edited")
    cfg = json.load(open(folder / "config.json"))
    edit(cfg)
    json.dump(cfg, open(folder / "config.json", "w"))
    for (_, logprobs), (_, hf_logprobs) in zip(_logprobs(str(folder)), expected["olmo3"]):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_norm_rounds_like_transformers_in_bf16():
    """OLMo's RMSNorm multiplies by the weight before rounding to bf16, Llama's after: other bits."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as HFOlmo2RMSNorm

    torch.manual_seed(0)
    x, weight = torch.randn(16, 64, dtype=torch.bfloat16), (torch.randn(64) * 3).to(torch.bfloat16)
    ours, llama, theirs = Olmo2RMSNorm(64, 1e-6), RMSNorm(64, 1e-6), HFOlmo2RMSNorm(64, 1e-6).to(torch.bfloat16)
    for norm in (ours, llama, theirs):
        norm.weight.data = weight.clone()
    assert torch.equal(ours(x), theirs(x))
    assert not torch.equal(llama(x), theirs(x))


def test_olmo3_config_as_released():
    """A config.json of Transformers 4.57 (Olmo-3-7B's): rope_theta and YaRN at the top, the layer types given or
    left to Olmo3Config's default (every fourth layer full). YaRN is the full layers'; the sliding ones' base is
    Olmo3Config's 500000."""
    base = {"architectures": ["Olmo3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 8, "num_attention_heads": 1, "max_position_embeddings": 65536, "rope_theta": 500000,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.sliding_windows == (4096, 4096, 4096, None) * 2
    assert (cfg.rope_scaling["rope_type"], cfg.hf_config["rope_local_base_freq"]) == ("yarn", 500000.0)
    assert cfg.hf_config.get("rope_local_scaling") is None
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        Olmo2ForCausalLM(ModelConfig.from_hf_dict({**base, "architectures": ["Olmo2ForCausalLM"],
                                                   "hidden_act": "gelu"}), 16)


def test_two_ranks_give_one_ranks_greedy_tokens(olmo_dirs):
    folder = olmo_dirs["olmo3-bias-mqa"]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


# ------------------------------------------------------------------------------------------------------------ GGUF

_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def olmo_to_gguf(folder: str, path: str) -> str:
    """A tiny OLMo 2 or 3 as llama.cpp's converter writes both: architecture "olmo2", Q and K rows as they are, and
    for OLMo 3 the full layers' RoPE (one base for all layers), its window and one sliding flag a layer."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    rope = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
    w = gguf.GGUFWriter(path, "olmo2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    add_byte_level_tokenizer(w)
    for name, t in sorted(tensors.items()):
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        gguf_name = f"blk.{layer[1]}.{_GGUF_LAYER[layer[2]]}.{layer[3]}" if layer else _GGUF_GLOBAL[name]
        w.add_tensor(gguf_name, np.ascontiguousarray(t))
    write_out(w)
    return path


@pytest.mark.usefixtures("isolated_gguf_cache")
@pytest.mark.parametrize("name", ["olmo2", "olmo3-bias-mqa"])
def test_gguf_generates_like_transformers(olmo_dirs, expected, name, tmp_path):
    folder = olmo_dirs[name]
    path = olmo_to_gguf(folder, str(tmp_path / f"{name}.gguf"))
    assert read_gguf(path).hf_config["architectures"] == json.load(open(f"{folder}/config.json"))["architectures"]
    _assert_matches(_logprobs(path), expected[name])
