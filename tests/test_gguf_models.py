"""Phi-3, mixture-of-experts, SmolLM3 and Granite GGUF files, written from tiny Hugging Face models with llama.cpp's
names and layouts (fused attn_qkv and ffn_up, stacked ffn_*_exps, LongRoPE factor tensors, permuted Q/K for
Mixtral's "llama" files and SmolLM3's and Granite's, Granite's *_scale keys): folio's greedy output from the GGUF
equals Transformers' from the Hugging Face folder."""

from __future__ import annotations

import json
import os
import re
from typing import Iterable

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import build_tiny_model, hf_greedy
from folio import LLM, SamplingParams
from int8_weights import int8_weight
from test_gguf_loader import _byte_level_vocab
from test_phi3 import VARIANTS as PHI3_VARIANTS

Q = gguf.GGMLQuantizationType
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate_up_proj": "ffn_up",
          "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",  # GLM-4's
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          # ERNIE 4.5 MoE's shared experts and correction bias (which the converter renames e_score_correction.bias)
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.moe_statics.e_score_correction": "exp_probs_b"}
# llama.cpp's names that differ by architecture: EXAONE 4's post-norms of the attention's and the MLP's outputs
_ARCH_LAYER = {"exaone4": {"post_attention_layernorm": "post_attention_norm",
                           "post_feedforward_layernorm": "post_ffw_norm"}}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation of llama-architecture models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_byte_level_tokenizer(w: gguf.GGUFWriter) -> None:
    """The test GPT-2 style vocabulary (test_gguf_loader._byte_level_vocab), end of text as id 2."""
    tokens, merges, types = _byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)


def write_out(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: gguf.GGUFWriter, name: str, t: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        w.add_tensor(name, np.ascontiguousarray(t))
    else:
        w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)


def add_named_tensors(w: gguf.GGUFWriter, names: gguf.TensorNameMap, tensors: Iterable[tuple[str, np.ndarray]],
                      layer_type: Q) -> None:
    """Each Hugging Face tensor under its llama.cpp name (gguf-py's map): the layers' matrices as layer_type where
    their rows allow it, the rest (norms, biases, routers, embeddings) float32, as llama.cpp's converter keeps them."""
    for name, t in tensors:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        quantize = (layer_type != Q.F32 and t.ndim >= 2 and gguf_name.startswith("blk.")
                    and "ffn_gate_inp" not in gguf_name and t.shape[-1] % gguf.GGML_QUANT_SIZES[layer_type][0] == 0)
        _add(w, gguf_name, t if quantize else np.asarray(t, dtype=np.float32), layer_type if quantize else Q.F32)


def hf_to_gguf(folder: str, path: str, arch: str, expert_type: Q = Q.F32, layer_type: Q = Q.F32) -> str:
    """Write a tiny Hugging Face model as llama.cpp would: float32 tensors, but the stacked experts as expert_type
    and the layers' other matrices as layer_type."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("moe_num_experts")
    if arch == "ernie4_5-moe":  # its converter: ERNIE's fields, its first sparse layer as the leading dense blocks
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["moe_k"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
    elif experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        shared = cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")  # Qwen's, Granite's
        if shared:
            w.add_expert_shared_feed_forward_length(shared)
    if arch == "exaone4" and cfg.get("sliding_window") is not None:  # its converter: the window, a flag a layer
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch in ("command-r", "cohere2"):  # llama.cpp's converter: Cohere's logit scale and LayerNorm epsilon
        w.add_logit_scale(cfg["logit_scale"])
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
    if arch == "cohere2":  # the window alone: llama.cpp hard-codes which layers slide (three of every four)
        w.add_sliding_window(cfg["sliding_window"])
    if arch in ("granite", "granitemoe"):  # llama.cpp's converter renames Granite's multipliers
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    add_byte_level_tokenizer(w)
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, t in sorted(tensors.items()):
        if m := _EXPERT.fullmatch(name):
            stacked.setdefault(f"blk.{m[1]}.ffn_{_EXPERT_PART[m[3]]}_exps.weight", {})[int(m[2])] = t
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                         "lm_head.weight": "output"}[name] + ".weight"
        else:
            converted = name.replace("e_score_correction_bias", "e_score_correction.bias")
            layer, part, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", converted).groups()
            gguf_name = f"blk.{layer}.{_ARCH_LAYER.get(arch, {}).get(part) or _LAYER[part]}.{suffix}"
            if arch in ("llama", "smollm3", "granite", "granitemoe") and part in ("self_attn.q_proj",
                                                                                 "self_attn.k_proj"):
                t = _permute(t, heads if part == "self_attn.q_proj" else kv_heads)
            if part in ("mlp.shared_expert_gate", "mlp.moe_statics.e_score_correction"):  # the converter squeezes
                t = t.reshape(-1)
        _add(w, gguf_name, t, layer_type if gguf_name.startswith("blk.") and t.ndim == 2 else Q.F32)
    for gguf_name, per_expert in stacked.items():
        _add(w, gguf_name, np.stack([per_expert[e] for e in range(experts)]), expert_type)
    write_out(w)
    return path


pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")


MODELS = {
    "phi3": ("phi3", "phi3", PHI3_VARIANTS["phi3"]),
    "phi4-mini": ("phi3", "phi3", PHI3_VARIANTS["phi4-mini"]),
    "phi3.5-longrope": ("phi3", "phi3", PHI3_VARIANTS["phi3.5-longrope"]),
    "mixtral": ("mixtral", "llama", {}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {"mlp_only_layers": []}),  # llama.cpp's qwen2moe: every layer sparse
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {}),
    "olmoe": ("olmoe", "olmoe", {}),
    # llama.cpp's SmolLM3 has every fourth layer NoPE (no GGUF key says so), as has this one (8 layers: 3 and 7)
    "smollm3": ("smollm3", "smollm3", {"num_hidden_layers": 8, "no_rope_layers": None}),
    "granite": ("granite", "granite", {}),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [100, 3, 250, 77, 1, 90]]


@pytest.mark.parametrize("model", list(MODELS))
def test_gguf_generates_like_transformers(tmp_path, model):
    hf_arch, gguf_arch, overrides = MODELS[model]
    folder = build_tiny_model(str(tmp_path / model), hf_arch, **overrides)
    path = hf_to_gguf(folder, str(tmp_path / f"{model}.gguf"), gguf_arch)
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    assert llm.llm_engine.model_config.architecture == json.load(open(f"{folder}/config.json"))["architectures"][0]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 16) for p in PROMPTS]


def _greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_phi3_fused_q8_0_layers_run_natively(tmp_path):
    """attn_qkv and the fused ffn_up load into the int8 layers shard by shard, as their blocks."""
    folder = build_tiny_model(str(tmp_path / "phi3"), "phi3")
    path = hf_to_gguf(folder, str(tmp_path / "phi3.gguf"), "phi3", layer_type=Q.Q8_0)
    native = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 22)
    layer = native.llm_engine.runner.model.layers[0]
    assert int8_weight(layer.self_attn.qkv_proj).dtype == int8_weight(layer.mlp.gate_up_proj).dtype == torch.int8
    dequantised = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    assert sum(g == w for g, w in zip(_greedy(native, 8), _greedy(dequantised, 8))) >= 2


def test_q8_0_experts_run_natively(tmp_path):
    folder = build_tiny_model(str(tmp_path / "q3"), "qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    path = hf_to_gguf(folder, str(tmp_path / "q3.gguf"), "qwen3moe", expert_type=Q.Q8_0)
    native = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 22)
    expert = native.llm_engine.runner.model.layers[1].mlp.experts[7]
    assert int8_weight(expert.gate_up_proj).dtype == int8_weight(expert.down_proj).dtype == torch.int8
    dequantised = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    assert sum(g == w for g, w in zip(_greedy(native, 8), _greedy(dequantised, 8))) >= 2
