"""Write a tiny DeepSeek V2/V3 or GLM-4.5 MoE Hugging Face folder as a GGUF file the way llama.cpp's converter does
(conversion/deepseek.py's DeepseekV2Model, conversion/glm.py's Glm4MoeModel, conversion/base.py's TextModel): its
metadata keys, gguf-py's own tensor names (gguf.TensorNameMap), experts stacked per layer, the correction bias renamed
e_score_correction.bias, and DeepSeek's kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, or, as files
from before that split, whole with per-head key/value lengths. No Q/K rows are permuted: llama.cpp rotates DeepSeek's
interleaved pairs and GLM-4.5's halves as the checkpoints hold them.

GLM-4.5's checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the decoder's, which the
converter keeps (its block count includes them); the tiny Transformers models have none, so one is made up here from
the last layer's tensors and eh_proj / enorm / hnorm / shared_head.norm, as GLM-4.5's layer 92 holds them.
"""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
from safetensors.torch import load_file

from folio.models.model_config import HF_DEFAULTS
from test_gguf_models import add_byte_level_tokenizer, add_named_tensors, write_out

Q = gguf.GGMLQuantizationType
ARCHS = {"DeepseekV2ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2, "DeepseekV3ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2,
         "Glm4MoeForCausalLM": gguf.MODEL_ARCH.GLM4_MOE}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def deepseek_to_gguf(folder: str, path: str, split_kv_b: bool = True, layer_type: Q = Q.F32) -> str:
    """The GGUF file, float32 but the layers' matrices (experts' included) as layer_type where their rows allow it
    (the router's stays float32, as llama.cpp's converter keeps it)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    hp = {**HF_DEFAULTS[cfg["architectures"][0]], **cfg}  # the router fields real config.json files state
    model_arch = ARCHS[cfg["architectures"][0]]
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    layers = hp["num_hidden_layers"]
    if model_arch == gguf.MODEL_ARCH.GLM4_MOE:
        tensors.update(_mtp_layer(tensors, layers, hp["hidden_size"]))
        layers += hp["num_nextn_predict_layers"]
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[model_arch])
    _write_metadata(w, hp, layers, model_arch, split_kv_b)
    add_byte_level_tokenizer(w)
    names = gguf.get_tensor_name_map(model_arch, layers)
    add_named_tensors(w, names, ((name.replace("e_score_correction_bias", "e_score_correction.bias"), t)
                                 for name, t in _llama_cpp_tensors(tensors, hp, split_kv_b)), layer_type)
    write_out(w)
    return path


def _write_metadata(w: gguf.GGUFWriter, hp: dict, layers: int, model_arch: gguf.MODEL_ARCH, split_kv_b: bool) -> None:
    rope = hp.get("rope_parameters") or {}
    deepseek = model_arch == gguf.MODEL_ARCH.DEEPSEEK2
    # TextModel.set_gguf_parameters (DeepseekV2Model first sets num_key_value_heads to 1, the latent's single row;
    # converters from before the split did not)
    w.add_block_count(layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(1 if deepseek and split_kv_b else hp["num_key_value_heads"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if hp["scoring_func"] == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    if not deepseek:  # Glm4MoeModel: the head, half of it rotating, and the multi-token-prediction layers
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        w.add_rope_dimension_count(int(hp["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
        w.add_nextn_predict_layers(hp["num_nextn_predict_layers"])
        return
    w.add_vocab_size(hp["vocab_size"])
    if hp["q_lora_rank"] is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    if split_kv_b:  # the latent row's widths, and a head's under the _mla keys
        w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
        w.add_value_length(hp["kv_lora_rank"])
        w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length_mla(hp["v_head_dim"])
    else:
        w.add_key_length(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length(hp["v_head_dim"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _llama_cpp_tensors(tensors: dict[str, np.ndarray], hp: dict, split_kv_b: bool):
    """(Hugging Face-style name, array) as DeepseekV2Model.modify_tensors hands them to the name map: experts stacked
    [experts, rows, cols], kv_b_proj split into k_b_proj [heads, kv_lora_rank, nope] and v_b_proj [heads, v, rank]."""
    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in sorted(tensors.items()):
        if m := _EXPERT.fullmatch(name):
            stacked.setdefault((m[1], m[3]), {})[int(m[2])] = t
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = hp["num_key_value_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
            kv_b = t.reshape(heads, nope + v, t.shape[-1])
            yield name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1)
            yield name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:]
        else:
            yield name, t
    for (layer, part), per_expert in stacked.items():
        yield f"model.layers.{layer}.mlp.experts.{part}.weight", np.stack([per_expert[e] for e in sorted(per_expert)])


def _mtp_layer(tensors: dict[str, np.ndarray], index: int, hidden: int) -> dict[str, np.ndarray]:
    """A multi-token-prediction layer at `index`: the last decoder layer's tensors, and its own projection and norms."""
    rng = np.random.default_rng(0)
    copied = {f"model.layers.{index}.{m[2]}": t for name, t in tensors.items()
              if (m := _LAYER.fullmatch(name)) and int(m[1]) == index - 1}
    own = {"eh_proj.weight": rng.normal(size=(hidden, 2 * hidden)), "enorm.weight": np.ones(hidden),
           "hnorm.weight": np.ones(hidden), "shared_head.norm.weight": np.ones(hidden)}
    return {**copied, **{f"model.layers.{index}.{k}": v.astype(np.float32) for k, v in own.items()}}
