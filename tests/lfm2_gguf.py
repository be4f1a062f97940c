"""Write a tiny LFM2 or LFM2-MoE Hugging Face folder as a GGUF file the way llama.cpp's converter does
(conversion/lfm2.py's LFM2Model and LFM2MoeModel over conversion/base.py's TextModel): the KV head count one a layer,
0 for a convolution layer; LFM2's feed_forward_length as its MLP's derived width (LFM2Model._add_feed_forward_length,
which overwrites TextModel's intermediate_size); shortconv.l_cache; LFM2-MoE's expert width, leading dense blocks and
sigmoid gating (no key for norm_topk_prob or routed_scaling_factor: llama.cpp hard-codes them); gguf-py's own tensor
names (gguf.TensorNameMap: the final norm as token_embd_norm), the convolution's kernel squeezed to [channels, taps],
experts stacked per layer, expert_bias renamed expert_bias.bias (exp_probs_b). No Q/K rows are permuted (TextModel's
tensors go as they are: llama.cpp rotates LFM2's halves). The router and the kernel stay float32, as the converter's
quantisation keeps them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator, Optional

import gguf
import numpy as np
from safetensors.torch import load_file

from test_gguf_models import add_byte_level_tokenizer, add_named_tensors, write_out

Q = gguf.GGMLQuantizationType
ARCHS = {"Lfm2ForCausalLM": gguf.MODEL_ARCH.LFM2, "Lfm2MoeForCausalLM": gguf.MODEL_ARCH.LFM2MOE}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight")


def lfm2_to_gguf(folder: str, path: str, layer_type: Q = Q.F32,
                 extra_metadata: Optional[Callable[[gguf.GGUFWriter], None]] = None) -> str:
    """The GGUF file, float32 but the layers' matrices (experts' included) as layer_type; extra_metadata writes
    further keys (or writes keys again: the last value stays)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    model_arch = ARCHS[cfg["architectures"][0]]
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[model_arch])
    _write_metadata(w, cfg, model_arch == gguf.MODEL_ARCH.LFM2MOE)
    if extra_metadata is not None:
        extra_metadata(w)
    add_byte_level_tokenizer(w)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    add_named_tensors(w, names, _llama_cpp_tensors(tensors), layer_type)
    write_out(w)
    return path


def _write_metadata(w: gguf.GGUFWriter, cfg: dict, moe: bool) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"] if moe else _lfm2_feed_forward_length(cfg))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    if moe:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _lfm2_feed_forward_length(cfg: dict) -> int:
    """LFM2Model._add_feed_forward_length."""
    ff_dim = cfg.get("block_ff_dim", cfg["intermediate_size"])
    if cfg["block_auto_adjust_ff_dim"]:
        ff_dim = int(2 * ff_dim / 3)
        if cfg["block_ffn_dim_multiplier"] is not None:
            ff_dim = int(cfg["block_ffn_dim_multiplier"] * ff_dim)
        multiple_of = cfg["block_multiple_of"]
        ff_dim = multiple_of * ((ff_dim + multiple_of - 1) // multiple_of)
    return ff_dim


def _llama_cpp_tensors(tensors: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face-style name, array) as LFM2Model / LFM2MoeModel hand them to the name map: the kernel squeezed,
    expert_bias with a .bias suffix, experts stacked [experts, rows, cols] under MOE_BLOCK_SPARSE's name."""
    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in sorted(tensors.items()):
        if m := _EXPERT.fullmatch(name):
            stacked.setdefault((m[1], m[3]), {})[int(m[2])] = t
        elif "conv.conv" in name:
            yield name, t.squeeze(1)
        elif name.endswith(".expert_bias"):
            yield f"{name}.bias", t
        else:
            yield name, t
    for (layer, part), per_expert in stacked.items():
        experts = np.stack([per_expert[e] for e in sorted(per_expert)])
        yield f"layers.{layer}.feed_forward.experts.{part}.weight", experts
