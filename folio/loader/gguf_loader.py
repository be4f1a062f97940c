"""Load a llama.cpp GGUF file as a Hugging Face-shaped checkpoint: config dict, tokenizer.json, weights.

The engine has one model path, written against Hugging Face names and config.json fields. So a GGUF is
translated into that shape here, and nothing downstream needs to know the weights came from llama.cpp.
What the translation has to undo:

* names: llama.cpp's `blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`;
* values: quantised blocks are dequantised (with the `gguf` package, the same code transformers uses);
* layout: llama.cpp's converter permutes the rows of Q and K of llama-architecture models so its
  rotary embedding can rotate adjacent pairs; Hugging Face rotates the two halves of each head;
* Gemma's norms: llama.cpp stores 1 + weight (its RMSNorm multiplies by the weight as stored), Hugging Face
  the weight; the one is taken off again (in float32, as Transformers does, and kept in float32: the model
  adds it back in float32). What llama.cpp hard-codes rather than stores comes back from its own rules:
  Gemma 2's default window and soft-caps, Gemma 3's local RoPE base, the layer patterns (Gemma 2: even
  layers slide; Gemma 3: five of six, and none without a sliding_window), and the attention scale
  (1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 27B models); SmolLM3's NoPE layers (every fourth);
* Granite's multipliers: stored as *_scale keys, back to their config.json names;
* Cohere's LayerNorm epsilon and logit scale, back to their config.json names; Command R+'s q/k norms, from their
  tensors; Cohere 2's window on three layers of every four (llama.cpp hard-codes the pattern);
* ERNIE 4.5 MoE: its layer layout from the leading dense block count and the MoE layer step, its router (and the
  correction bias, `exp_probs_b`, whose unit dim llama.cpp drops) kept in float32, as Transformers keeps it;
* GPT-OSS: its window on the even layers and YaRN without truncation (GptOssConfig's), its SwiGLU clamp at
  Transformers' defaults (llama.cpp hard-codes them); its stacked experts' biases one per expert as its weights;
  its MXFP4 experts, where they run as stored, repacked from ggml's block order into the blocks and scales the
  Hugging Face checkpoints hold (`weight` and `weight_scale`, as the MXFP4 method loads them);
* DeepSeek V2/V3 and GLM-4.5: kv_b_proj whole again from the per-head halves newer converters store (attn_k_b
  transposed, attn_v_b), the router's settings and correction bias back under DeepSeek's names, YaRN's mscale from
  yarn_log_multiplier (`_mla_config`); GLM-4.5's multi-token-prediction blocks (in its block count) left out;
* LFM2 and LFM2-MoE: the layer types from the per-layer KV head counts (0: a convolution layer), the MLP width as
  stored (LFM2's already derived), the convolution's kernel unsqueezed back to Conv1d's shape, the final norm under
  llama.cpp's token_embd_norm (`_lfm2_config`); LFM2-MoE's router as llama.cpp runs it (`_lfm2_moe_config`);
* the tokenizer: a GGUF stores vocabulary, merges and token types as metadata, not a tokenizer.json,
  so one is rebuilt with the `tokenizers` library, splitting text the way llama.cpp does.

Dequantising takes seconds, so `load_gguf_cached` keeps the converted result as safetensors + json
files laid out like a Hugging Face model folder, and later loads memory-map them instead. Layers that run as
stored (folio.loader.gguf_native, the default for a GGUF file) are cached likewise, their blocks as uint8
rows, MXFP4 ones already repacked (`read_gguf_cached`, `load_gguf_native_cached`): reading a file's metadata
alone takes GGUFReader seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Union

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from folio import envs
from folio.harmony import CALL, RETURN
from folio.loader.gguf_metadata import check_exists, get_field, need_field, open_gguf
from folio.loader.gguf_tokenizer import build_tokenizer
from folio.models.model_config import num_experts

if TYPE_CHECKING:
    from folio.loader.gguf_native import GGUFBlocks

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> Hugging Face architecture and model_type. Mistral GGUFs are written as
# "llama" by llama.cpp (gguf has no plain "mistral" architecture), so they load as Llama, as in transformers.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "ernie4_5": ("Ernie4_5ForCausalLM", "ernie4_5"),  # Q/K as in Transformers: llama.cpp rotates ERNIE's pairs
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe"),  # likewise
    "exaone4": ("Exaone4ForCausalLM", "exaone4"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),  # and GraniteMoeShared: one class serves both
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "chatglm": ("GlmForCausalLM", "glm"),  # GLM-4-9B-0414's predecessors: glm-4-9b-chat(-hf), ChatGLM2/3
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "command-r": ("CohereForCausalLM", "cohere"),  # Q/K as in Transformers: llama.cpp rotates Cohere's pairs
    "cohere2": ("Cohere2ForCausalLM", "cohere2"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # and V3 (DEEPSEEK_V3): one class serves both
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),
    "lfm2": ("Lfm2ForCausalLM", "lfm2"),  # Q/K as in Transformers: llama.cpp rotates LFM2's halves (NEOX)
    "lfm2moe": ("Lfm2MoeForCausalLM", "lfm2_moe"),  # likewise
}
# llama.cpp writes Mixtral as "llama" with experts (llama.expert_count).
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# and OLMo 3 as "olmo2" with a sliding window (olmo2.attention.sliding_window).
OLMO3 = ("Olmo3ForCausalLM", "olmo3")
# and DeepSeek V3 as "deepseek2" with a router correction bias (exp_probs_b).
DEEPSEEK_V3 = ("DeepseekV3ForCausalLM", "deepseek_v3")
# DeepSeek's grouped router and shared experts (folio.models.grouped_topk): DeepSeek V2/V3 and GLM-4.5 MoE.
GROUPED_MOE = frozenset({"deepseek2", "glm4moe"})
# llama.cpp's expert_gating_func -> DeepSeek's scoring_func.
SCORING_FUNCS = {ExpertGatingFuncType.SOFTMAX: "softmax", ExpertGatingFuncType.SIGMOID: "sigmoid"}
# The model types whose Q and K rows llama.cpp's converter permutes (its LlamaModel and subclasses).
PERMUTED_QK = frozenset({"llama", "mixtral", "smollm3", "granite", "granitemoe"})
GEMMA = frozenset({"gemma2", "gemma3"})
GEMMA_NORMS = GEMMA | {"gemma"}  # norms stored as 1 + weight (Gemma 1 has Llama's two norms a layer and names)
# GLM's Q and K are not permuted (llama.cpp rotates GLM's interleaved pairs as they are). Phi-3's files fuse q/k/v
# (attn_qkv), ChatGLM's may.
GLM = frozenset({"glm4", "chatglm"})
FUSED_QKV = frozenset({"phi3", "chatglm"})

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
     Q.MXFP4}
)

# llama.cpp tensor names -> Hugging Face names: model-wide ones, and the per-layer ones of `blk.N.`
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v, as in its Hugging Face checkpoints
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# DeepSeek's shared experts (several experts' worth of one MLP) and its router's correction bias, which llama.cpp's
# converter renames e_score_correction.bias (Hugging Face: e_score_correction_bias, _CORRECTION_BIAS)
_DEEPSEEK_MOE_TENSORS = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                         "ffn_down_shexp": "mlp.shared_experts.down_proj", "exp_probs_b": "mlp.gate.e_score_correction"}
_CORRECTION_BIAS = ("e_score_correction.bias", "e_score_correction_bias")
# DeepSeek's kv_b_proj, which newer llama.cpp converters store split per head: attn_k_b (W_UK transposed) and attn_v_b
# (W_UV). The first stands for the rebuilt whole (_kv_b_proj), the second is read with it.
KV_B_SPLIT = ("attn_k_b", "attn_v_b")
# LFM2's final norm, which llama.cpp names token_embd_norm, and its short convolutions (the converter squeezes the
# kernel's unit dim: `_iter_tensors` puts it back)
LFM2 = frozenset({"lfm2", "lfm2moe"})
_ARCH_GLOBAL_TENSORS = dict.fromkeys(LFM2, {"token_embd_norm": "model.norm"})
_LFM2_TENSORS = {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                 "shortconv.out_proj": "conv.out_proj"}
# Per-architecture exceptions: Phi-3's and GLM's ffn_up hold gate and up, fused as in their Hugging Face checkpoints.
_ARCH_LAYER_TENSORS = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "chatglm": {"ffn_up": "mlp.gate_up_proj"},
                       # OLMo 2's post-norms: of the attention's and of the MLP's outputs
                       "olmo2": {"post_attention_norm": "post_attention_layernorm",
                                 "post_ffw_norm": "post_feedforward_layernorm"},
                       # EXAONE 4's post-norms likewise
                       "exaone4": {"post_attention_norm": "post_attention_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"},
                       # GLM-4's sandwich norms: after the attention and after the MLP
                       "glm4": {"ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
                                "post_ffw_norm": "post_mlp_layernorm"},
                       # GPT-OSS's pre-MLP norm, attention sinks (attn_sinks.weight) and router (with a bias)
                       "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                                   "ffn_gate_inp": "mlp.router"},
                       # ERNIE 4.5 MoE's shared experts (plural) and its router's correction bias (`_hf_names`)
                       "ernie4_5-moe": {"ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                                        "ffn_up_shexp": "mlp.shared_experts.up_proj",
                                        "ffn_down_shexp": "mlp.shared_experts.down_proj",
                                        "exp_probs_b": "mlp.moe_statics.e_score_correction"},
                       # DeepSeek's latent attention: queries through q_a / q_b (attn_q without, V2-Lite), the latent
                       # and shared rotated key (kv_a_mqa), its expansion per head (kv_b, or k_b and v_b)
                       "deepseek2": {**_DEEPSEEK_MOE_TENSORS, "attn_q_a": "self_attn.q_a_proj",
                                     "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
                                     "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                                     "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                                     KV_B_SPLIT[0]: "self_attn.kv_b_proj"},
                       # GLM-4.5's pre-MLP norm is the one after the attention in llama.cpp's names
                       "glm4moe": {**_DEEPSEEK_MOE_TENSORS, "post_attention_norm": "post_attention_layernorm"},
                       # LFM2-MoE's expert_bias: its router's correction bias, as DeepSeek's (folio.models.lfm2_moe)
                       "lfm2": _LFM2_TENSORS, "lfm2moe": {**_LFM2_TENSORS, **_DEEPSEEK_MOE_TENSORS}}
# Tensors that stay float32 whatever the dtype asked for: ERNIE 4.5 MoE's router, which Transformers keeps in float32,
# and DeepSeek's, GLM-4.5's and LFM2-MoE's correction bias, which their float32 router adds
_FLOAT32_TENSORS = {"ernie4_5-moe": ("ffn_gate_inp.weight", "exp_probs_b.bias"), "deepseek2": ("exp_probs_b.bias",),
                    "glm4moe": ("exp_probs_b.bias",), "lfm2moe": ("exp_probs_b.bias",)}
# Stacked expert tensors [experts, rows, cols]: one Hugging Face tensor per expert, mlp.experts.E.<name>.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward one there
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)")  # LFM2's hold a dot: shortconv.in_proj
_ATTN_Q = re.compile(r"blk\.\d+\.attn_q\.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.")
# Llama 3.1+ rope scaling factors: folded into hf_config's rope_scaling, not a model weight.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors: folded into rope_scaling likewise.
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
_NOT_WEIGHTS = frozenset({ROPE_FREQS, *ROPE_FACTORS.values()})

# Bumped whenever the conversion changes, so stale caches are not reused.
_CACHE_VERSION = 3


@dataclass
class GGUFCheckpoint:
    """Everything but the weights, in the shapes of a Hugging Face folder's json files."""

    hf_config: dict  # config.json: parses with ModelConfig.from_hf_dict
    tokenizer_json: str  # tokenizer.json: loads with tokenizers.Tokenizer.from_str
    tokenizer_config: dict  # tokenizer_config.json: chat_template, special tokens, add_bos_token
    generation_config: dict  # generation_config.json: bos/eos(/pad) token ids


def read_gguf(path: str) -> GGUFCheckpoint:
    """Config, tokenizer and generation settings of a GGUF file, without dequantising its weights."""
    return _checkpoint(open_gguf(path))


def load_gguf_tensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file under its Hugging Face name, dequantised to `dtype`."""
    reader = open_gguf(path)
    return _tensors(reader, _hf_config(reader), dtype)


def load_gguf_cached(path: str, dtype: torch.dtype) -> tuple[GGUFCheckpoint, dict[str, torch.Tensor]]:
    """`read_gguf` + `load_gguf_tensors`, converted once and then read back from a cache folder.

    The cache key covers the file's absolute path, size and mtime and the dtype, so an edited or
    replaced file is converted again. The folder appears with a single rename once it is complete,
    so a crash mid-write leaves at most an ignored temporary folder, never a half cache.
    """
    check_exists(path)
    cache_dir = _cache_dir(path, str(dtype))
    if os.path.isdir(cache_dir):
        return _read_cache(cache_dir)
    reader = open_gguf(path)
    checkpoint = _checkpoint(reader)
    tensors = _tensors(reader, checkpoint.hf_config, dtype)
    _try_write_cache(cache_dir, checkpoint, tensors)
    return checkpoint, tensors


def read_gguf_cached(path: str) -> tuple[GGUFCheckpoint, dict[str, GGMLQuantizationType]]:
    """`read_gguf` and `tensor_types`, read once and then from a cache folder's json files: GGUFReader parses a
    file's whole vocabulary in Python, seconds for the default model, on every open."""
    check_exists(path)
    cache_dir = _cache_dir(path, "metadata")
    if os.path.isdir(cache_dir):
        checkpoint, _ = _read_cache(cache_dir)
        types = json.loads(_read_text(cache_dir, "types.json"))
        return checkpoint, {name: GGMLQuantizationType(t) for name, t in types.items()}
    reader = open_gguf(path)
    checkpoint = _checkpoint(reader)
    types = _tensor_types(reader, checkpoint.hf_config)
    _try_write_cache(cache_dir, checkpoint, {}, {"types.json": json.dumps({n: int(t) for n, t in types.items()})})
    return checkpoint, types


def load_gguf_native_cached(path: str, dtype: torch.dtype, checkpoint: GGUFCheckpoint,
                            types: dict[str, GGMLQuantizationType],
                            keep_quantized: frozenset[str]) -> dict[str, Union[torch.Tensor, "GGUFBlocks"]]:
    """Every weight under its Hugging Face name, dequantised to dtype except those named in keep_quantized,
    which come as their blocks (folio.loader.gguf_native.GGUFBlocks), or, MXFP4 ones, as the MXFP4 method's
    blocks and scales (`_iter_tensors`); converted once and then read back from a cache folder (as
    `load_gguf_cached` caches the dequantised form), the kept ones as their uint8 rows. checkpoint, types: the
    file's, from `read_gguf_cached`. The key covers the kept set, which is the loading model's choice."""
    from folio.loader.gguf_native import GGUFBlocks  # its linear methods import the kernels' build machinery

    kept = hashlib.sha256("|".join(sorted(keep_quantized)).encode()).hexdigest()[:16]
    cache_dir = _cache_dir(path, f"{dtype}|native|{kept}")
    if os.path.isdir(cache_dir):
        _, tensors = _read_cache(cache_dir)
        return {name: GGUFBlocks(types[name], t.numpy()) if name in keep_quantized and types[name] != Q.MXFP4
                else t for name, t in tensors.items()}
    weights = dict(_iter_tensors(open_gguf(path), checkpoint.hf_config, dtype, keep_quantized))
    _try_write_cache(cache_dir, checkpoint,
                     {name: torch.from_numpy(np.ascontiguousarray(w.blocks)) if isinstance(w, GGUFBlocks) else w
                      for name, w in weights.items()})
    return weights


# ---------------------------------------------------------------------------------------------- reading


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _architecture(reader: GGUFReader) -> str:
    arch = get_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; folio supports {', '.join(ARCHITECTURES)}")
    return arch


def _hf_config(reader: GGUFReader) -> dict:
    arch = _architecture(reader)
    hf_arch, model_type = ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    # block 0's q, or a hybrid's first attention layer's (LFM2's first layers may be convolutions)
    q_name = min((name for name in tensors if _ATTN_Q.fullmatch(name)), key=lambda name: int(_BLOCK.match(name)[1]),
                 default="blk.0.attn_q.weight")
    fused_qkv = arch in FUSED_QKV and q_name not in tensors
    attention = ("blk.0.attn_kv_a_mqa.weight" if arch == "deepseek2"
                 else "blk.0.attn_qkv.weight" if fused_qkv else q_name)
    for name in ("token_embd.weight", attention):
        if name not in tensors:
            raise ValueError(f"the GGUF file has no tensor {name!r}")
    heads = int(need_field(reader, f"{arch}.attention.head_count"))
    hidden = int(need_field(reader, f"{arch}.embedding_length"))
    # key_length is only written when it differs from hidden/heads (Qwen3); q's rows always tell. DeepSeek's is the
    # latent row's (or a whole query head's): its configs' head_dim is the rotated part's.
    q_rows = int(tensors[q_name].shape[1]) if q_name in tensors else hidden
    head_dim = int(get_field(reader, f"{arch}.rope.dimension_count" if arch == "deepseek2"
                             else f"{arch}.attention.key_length", q_rows // heads))
    if arch == "llama" and get_field(reader, "llama.expert_count"):
        hf_arch, model_type = MIXTRAL
    if arch == "olmo2" and get_field(reader, "olmo2.attention.sliding_window"):
        hf_arch, model_type = OLMO3
    if arch == "deepseek2" and _correction_bias(tensors):
        hf_arch, model_type = DEEPSEEK_V3
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml order: (hidden, vocab)
        "hidden_size": hidden,
        "intermediate_size": int(need_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(need_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(reader, arch, heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": q_name.replace(".weight", ".bias") in tensors or "blk.0.attn_qkv.bias" in tensors,
        "bos_token_id": get_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": get_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    config.update(_grouped_moe_config(reader, arch, tensors) if arch in GROUPED_MOE
                  else _lfm2_moe_config(reader, arch, tensors) if arch == "lfm2moe"
                  else _moe_config(reader, arch, model_type))
    rope_dim = int(get_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    rope_type = get_field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type != "none":
        config["rope_scaling"] = {"rope_type": rope_type,
                                  "factor": _f32(need_field(reader, f"{arch}.rope.scaling.factor"))}
        original = get_field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
        for beta in ("beta_fast", "beta_slow"):  # YaRN's ramp, where the file states it (else Transformers' 32 and 1)
            value = get_field(reader, f"{arch}.rope.scaling.yarn_{beta}")
            if value is not None:
                config["rope_scaling"][beta] = _f32(value)
    if ROPE_FACTORS["long_factor"] in tensors:
        original = need_field(reader, f"{arch}.rope.scaling.original_context_length")
        config["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = {"rope_type": "longrope", **{
            key: [_f32(v) for v in dequantize(tensors[name].data, tensors[name].tensor_type).reshape(-1)]
            for key, name in ROPE_FACTORS.items()}}
    if ROPE_FREQS in tensors:
        factors = dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        config["rope_scaling"] = _llama3_rope_scaling(factors, config["rope_theta"], rope_dim)
    if arch in GEMMA:
        config.update(_gemma_config(reader, arch, config))
    if arch in ("granite", "granitemoe"):
        config.update(_granite_config(reader, arch, head_dim))
    if model_type == "olmo3":
        config.update(_olmo3_config(reader, arch, config))
    if arch in ("command-r", "cohere2"):
        config.update(_cohere_config(reader, arch, tensors))
    if arch in ("exaone4", "cohere2"):
        config.update(_hybrid_attention_config(reader, arch))
    if arch == "smollm3":  # llama.cpp hard-codes SmolLM3's NoPE layers (every fourth): no GGUF key says so
        config["no_rope_layer_interval"] = 4
    if arch in GLM or arch == "glm4moe":  # stated whatever it is: Transformers' GLM configs default to half a head
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "deepseek2":
        config.update(_mla_config(reader, arch, tensors, config))
    if arch == "glm4moe":
        config.update(_glm4_moe_config(reader, arch, tensors, config))
    if arch in LFM2:
        config.update(_lfm2_config(reader, arch, config))
    if arch == "gpt-oss":  # the window of its even layers; GptOssConfig's YaRN does not truncate its ramp
        config["sliding_window"] = int(need_field(reader, "gpt-oss.attention.sliding_window"))
        if "rope_scaling" in config:
            config["rope_scaling"]["truncate"] = False
    return config


def _kv_heads(reader: GGUFReader, arch: str, heads: int) -> int:
    """The attention layers' KV heads: one count, or, in LFM2's files, one a layer, 0 for a convolution layer
    (`_lfm2_config`), as llama.cpp's converter writes them."""
    value = get_field(reader, f"{arch}.attention.head_count_kv", heads)
    if not isinstance(value, list):
        return int(value)
    counts = set(value) - {0}
    if arch not in LFM2 or len(counts) != 1:
        raise ValueError(f"{arch}.attention.head_count_kv {value}: KV head counts per layer are not supported "
                         "(supported: one count, or LFM2's, 0 for a convolution layer)")
    return int(counts.pop())


def _lfm2_config(reader: GGUFReader, arch: str, config: dict) -> dict:
    """LFM2's and LFM2-MoE's fields as llama.cpp reads them: a layer without KV heads is a gated convolution over
    shortconv.l_cache tokens, without biases (llama.cpp's graph has none); the norms' epsilon is required; LFM2's
    feed_forward_length is the width Lfm2MLP derives (the converter's), not to be derived again. What llama.cpp
    runs otherwise is refused: a sliding window (LFM2.5's audio tokenizer) and bidirectional attention."""
    if get_field(reader, f"{arch}.attention.sliding_window"):
        raise ValueError(f"{arch}.attention.sliding_window is not supported (folio's LFM2 attends without a window)")
    if get_field(reader, f"{arch}.attention.causal", True) is False:
        raise ValueError(f"{arch}.attention.causal false (bidirectional LFM2) is not supported")
    kv_heads = get_field(reader, f"{arch}.attention.head_count_kv", config["num_attention_heads"])
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * config["num_hidden_layers"]
    extra = {"layer_types": ["conv" if n == 0 else "full_attention" for n in per_layer],
             "conv_L_cache": int(need_field(reader, f"{arch}.shortconv.l_cache")), "conv_bias": False,
             "norm_eps": _f32(need_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))}
    return {**extra, "block_auto_adjust_ff_dim": False} if arch == "lfm2" else extra


def _lfm2_moe_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """LFM2-MoE's experts and router under Lfm2MoeConfig's names, as llama.cpp's graph runs them: sigmoid scores
    (the expert_gating_func its converter writes; another is refused), the correction bias (exp_probs_b) choosing
    where the file has it, the weights always renormalised (llama.cpp hard-codes it: no key says so) and scaled by
    expert_weights_scale where the file has one; dense leading blocks as leading_dense_block_count says (none
    without it, as llama.cpp reads it)."""
    gating = int(need_field(reader, f"{arch}.expert_gating_func"))
    if gating != ExpertGatingFuncType.SIGMOID:
        raise ValueError(f"unsupported {arch}.expert_gating_func {gating} "
                         f"(supported: {int(ExpertGatingFuncType.SIGMOID)} (sigmoid))")
    return {"num_experts": int(need_field(reader, f"{arch}.expert_count")),
            "num_experts_per_tok": int(need_field(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(need_field(reader, f"{arch}.expert_feed_forward_length")),
            "num_dense_layers": int(get_field(reader, f"{arch}.leading_dense_block_count", 0)),
            "use_expert_bias": _correction_bias(tensors), "norm_topk_prob": True,
            "routed_scaling_factor": _f32(get_field(reader, f"{arch}.expert_weights_scale") or 1.0)}


def _moe_config(reader: GGUFReader, arch: str, model_type: str) -> dict:
    """The config.json fields of a mixture of experts (none for a dense model)."""
    experts = get_field(reader, f"{arch}.expert_count")
    if not experts:
        return {}
    if model_type == "ernie4_5_moe":
        return _ernie4_5_moe_config(reader, arch, int(experts))
    config = {"num_experts_per_tok": int(need_field(reader, f"{arch}.expert_used_count"))}
    if model_type == "mixtral":
        return {**config, "num_local_experts": int(experts)}
    shared = get_field(reader, f"{arch}.expert_shared_feed_forward_length")
    return {**config, "num_experts": int(experts),
            # OLMoE's files give the experts' size as feed_forward_length only
            "moe_intermediate_size": int(get_field(reader, f"{arch}.expert_feed_forward_length")
                                         or need_field(reader, f"{arch}.feed_forward_length")),
            "shared_expert_intermediate_size": int(shared or 0),
            # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's unless the file says so
            "norm_topk_prob": bool(get_field(reader, f"{arch}.expert_weights_norm", model_type == "qwen3_moe"))}


def _ernie4_5_moe_config(reader: GGUFReader, arch: str, experts: int) -> dict:
    """ERNIE 4.5 MoE's fields under their config.json names, as llama.cpp's converter writes them: the shared
    experts' count (none where it is absent), the first sparse layer as the leading dense block count, the sparse
    layers' interval as the MoE layer step. llama.cpp's sparse layers run to the last one (Transformers' default
    moe_layer_end_index) and it floors the weights' sum at its own constant: moe_norm_min keeps Transformers'
    default, which no router sum comes near."""
    return {"moe_num_experts": experts, "moe_k": int(need_field(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(need_field(reader, f"{arch}.expert_feed_forward_length")),
            "moe_num_shared_experts": int(get_field(reader, f"{arch}.expert_shared_count", 0)),
            "moe_layer_start_index": int(need_field(reader, f"{arch}.leading_dense_block_count")),
            "moe_layer_interval": int(need_field(reader, f"{arch}.interleave_moe_layer_step")),
            "moe_layer_end_index": -1}
def _correction_bias(tensors: dict) -> bool:
    """Whether the file's router has DeepSeek V3's correction bias (on its sparse layers: any of them)."""
    return any(name.endswith(".exp_probs_b.bias") for name in tensors)


def _grouped_moe_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """DeepSeek's router and experts (DeepSeek V2/V3, GLM-4.5) under their config.json names. The file states the
    scoring (expert_gating_func; without it llama.cpp takes softmax for deepseek2, sigmoid for glm4moe) but not how
    groups of experts are ranked: a correction bias means V3's noaux_tc (groups by their two best biased scores, as
    llama.cpp ranks any groups), groups without one V2's group_limited_greedy (Transformers ranks them by their best
    score, llama.cpp by their two best: folio keeps the checkpoint's rule), no groups greedy. An unset or zero
    expert_weights_scale is llama.cpp's "no scaling"."""
    default = ExpertGatingFuncType.SIGMOID if arch == "glm4moe" else ExpertGatingFuncType.SOFTMAX
    gating = int(get_field(reader, f"{arch}.expert_gating_func", default))
    if gating not in SCORING_FUNCS:
        raise ValueError(f"unsupported {arch}.expert_gating_func {gating} (supported: "
                         f"{', '.join(f'{int(k)} ({v})' for k, v in SCORING_FUNCS.items())})")
    groups = int(get_field(reader, f"{arch}.expert_group_count") or 1)
    biased = _correction_bias(tensors)
    return {"n_routed_experts": int(need_field(reader, f"{arch}.expert_count")),
            "num_experts_per_tok": int(need_field(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(need_field(reader, f"{arch}.expert_feed_forward_length")),
            "n_shared_experts": int(get_field(reader, f"{arch}.expert_shared_count", 0)),
            "first_k_dense_replace": int(get_field(reader, f"{arch}.leading_dense_block_count", 0)),
            "n_group": groups, "topk_group": int(get_field(reader, f"{arch}.expert_group_used_count") or groups),
            "norm_topk_prob": bool(get_field(reader, f"{arch}.expert_weights_norm", False)),
            "routed_scaling_factor": _f32(get_field(reader, f"{arch}.expert_weights_scale") or 1.0),
            "scoring_func": SCORING_FUNCS[gating],
            "topk_method": "noaux_tc" if biased else "group_limited_greedy" if groups > 1 else "greedy"}


def _mla_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> dict:
    """DeepSeek's latent attention sizes, and its YaRN's mscale.

    llama.cpp's converter writes the latent row's widths as key_length / value_length and a head's as
    key_length_mla / value_length_mla (and splits kv_b_proj, KV_B_SPLIT); files from before that split have a
    head's widths under the plain keys and kv_b_proj whole (attn_kv_b). A file with attn_q has no query bottleneck
    (V2-Lite). YaRN's yarn_log_multiplier is 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it (as DeepSeek's
    configs have them), so the rotary tables keep their scale and only the softmax sharpens, by mscale_all_dim's."""
    rope = int(need_field(reader, f"{arch}.rope.dimension_count"))
    key = get_field(reader, f"{arch}.attention.key_length_mla") or need_field(reader, f"{arch}.attention.key_length")
    value = (get_field(reader, f"{arch}.attention.value_length_mla")
             or need_field(reader, f"{arch}.attention.value_length"))
    extra = {"num_key_value_heads": config["num_attention_heads"],  # the checkpoint's; the cache keeps one latent row
             "q_lora_rank": (None if "blk.0.attn_q.weight" in tensors
                             else int(need_field(reader, f"{arch}.attention.q_lora_rank"))),
             "kv_lora_rank": int(need_field(reader, f"{arch}.attention.kv_lora_rank")),
             "qk_nope_head_dim": int(key) - rope, "qk_rope_head_dim": rope, "v_head_dim": int(value)}
    log_multiplier = get_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_multiplier and "rope_scaling" in config:
        mscale = _f32(_f32(log_multiplier) * 10)  # from the decimal 0.1 * mscale_all_dim was written from
        extra["rope_scaling"] = {**config["rope_scaling"], "mscale": mscale, "mscale_all_dim": mscale}
    return extra


def _glm4_moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> dict:
    """GLM-4.5's block count includes its multi-token-prediction layers (nextn_predict_layers, after the decoder's:
    not served, their tensors skipped); its per-head q/k norms are there or not (the 355B's are)."""
    mtp_layers = int(get_field(reader, f"{arch}.nextn_predict_layers", 0))
    return {"num_hidden_layers": config["num_hidden_layers"] - mtp_layers,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def _granite_config(reader: GGUFReader, arch: str, head_dim: int) -> dict:
    """Granite's multipliers, which llama.cpp's converter writes as *_scale keys where they are non-zero; an absent
    one means what llama.cpp's graph then does: no scaling, and the attention's usual 1 / sqrt(head_dim)."""
    def scale(key: str, default: float) -> float:
        value = get_field(reader, f"{arch}.{key}")
        return _f32(value) if value else default

    return {"embedding_multiplier": scale("embedding_scale", 1.0), "residual_multiplier": scale("residual_scale", 1.0),
            "attention_multiplier": scale("attention.scale", head_dim ** -0.5),
            "logits_scaling": scale("logit_scale", 1.0)}



def _olmo3_config(reader: GGUFReader, arch: str, config: dict) -> dict:
    """OLMo 3's window and sliding layers (llama.cpp's converter writes the pattern as one flag a layer; without
    it, Transformers' default: every fourth layer full). llama.cpp rotates the sliding layers with the file's RoPE
    base (or freq_base_swa) unscaled: the full layers' scaling is theirs alone, as in Transformers."""
    extra = {"sliding_window": int(need_field(reader, f"{arch}.attention.sliding_window")),
             "rope_local_base_freq": _f32(get_field(reader, f"{arch}.rope.freq_base_swa", config["rope_theta"]))}
    pattern = get_field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        extra["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    return extra


def _cohere_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """Cohere's LayerNorm epsilon and logit scale (keys llama.cpp requires), and q/k norms where the file has their
    tensors (llama.cpp's Command-R: in models of 64 layers or more, Command R+)."""
    return {"layer_norm_eps": _f32(need_field(reader, f"{arch}.attention.layer_norm_epsilon")),
            "logit_scale": _f32(need_field(reader, f"{arch}.logit_scale")),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def _hybrid_attention_config(reader: GGUFReader, arch: str) -> dict:
    """EXAONE 4's and Cohere 2's window, and their sliding layers where the file lists them (one flag a layer; else
    Transformers' sliding_window_pattern 4, which llama.cpp hard-codes for Cohere 2). No window (EXAONE 4.0 1.2B):
    every layer global (and rotated in EXAONE 4, NoPE in Cohere 2, as in Transformers)."""
    window = get_field(reader, f"{arch}.attention.sliding_window")
    extra = {"sliding_window": int(window) if window else None}
    pattern = get_field(reader, f"{arch}.attention.sliding_window_pattern")
    if window and isinstance(pattern, list):
        extra["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    return extra


# llama.cpp's block counts of the 27B models, whose attention scale is 1 / sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(reader: GGUFReader, arch: str, config: dict) -> dict:
    """Gemma's fields of config.json, from the metadata llama.cpp writes and the defaults it applies."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    extra = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
    }
    final_cap = get_field(reader, f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None)
    extra["final_logit_softcapping"] = _f32(final_cap) if final_cap else None
    window = get_field(reader, f"{arch}.attention.sliding_window")
    extra["sliding_window"] = int(window) if window else None
    pattern = get_field(reader, f"{arch}.attention.sliding_window_pattern")
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = _f32(get_field(reader, f"{arch}.attn_logit_softcapping", 50.0)) or None
        if extra["sliding_window"] is None:  # llama.cpp's Gemma 2 always slides
            extra["sliding_window"] = 4096
    else:
        extra["rope_local_base_freq"] = _f32(get_field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    if isinstance(pattern, list):  # per layer: whether it slides
        extra["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:  # every pattern-th layer is global
        extra["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                for i in range(layers)]
    return extra


def _llama3_rope_scaling(factors: np.ndarray, theta: float, dim: int) -> dict:
    """Recover Hugging Face's llama3 rope_scaling from the per-frequency factors llama.cpp stores instead.

    Llama 3.1+ GGUFs carry their rope scaling only as `rope_freqs.weight`. llama.cpp's converter
    computes it with low/high frequency factors 1 and 4 and an original context of 8192 (the values of
    every Llama 3.x release; the converter itself falls back to them); the scale is the largest factor.
    Recomputing the factors from those guards against a file made differently.
    """
    scaling = {
        "rope_type": "llama3", "factor": _f32(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_rope_factors(theta, dim, scaling), factors, rtol=1e-5):
        raise ValueError(f"the GGUF file's {ROPE_FREQS} is not llama3 rope scaling as llama.cpp writes it")
    return scaling


def _llama3_rope_factors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py computation of `rope_freqs`, vectorised."""
    freqs = (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32).astype(np.float64)
    wavelen = 2 * np.pi / freqs
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    smooth = (old / wavelen - low) / (high - low)
    ramp = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, scaling["factor"], ramp))


def stop_token_ids(arch: str, tokens: list[str], eos: Optional[int], eot: Optional[int],
                   eom: Optional[int]) -> list[int]:
    """The ids generation stops at, as llama.cpp's vocabulary marks the ends of generation: EOS, and the end-of-turn
    and end-of-message ids, where the file has them; for GPT-OSS, harmony's <|return|> and <|call|> by their text
    (llama.cpp's converter stores one of them as EOS, and its vocabulary adds the other by name)."""
    named = [tokens.index(text) for text in (RETURN, CALL) if text in tokens] if arch == "gpt-oss" else []
    return [i for i in dict.fromkeys([eos, eot, eom, *named]) if i is not None]


def _checkpoint(reader: GGUFReader) -> GGUFCheckpoint:
    hf_config = _hf_config(reader)
    tokens = get_field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    model = get_field(reader, "tokenizer.ggml.model")
    special = {
        name: get_field(reader, f"tokenizer.ggml.{key}_token_id")
        for name, key in {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}.items()
    }
    # SentencePiece files without the flag want BOS (llama.cpp's and transformers' default); BPE ones do not.
    add_bos = bool(get_field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(get_field(reader, "tokenizer.ggml.add_eos_token", False))
    tokenizer_config = {
        "chat_template": get_field(reader, "tokenizer.chat_template"),
        **{f"{name}_token": None if i is None else tokens[i] for name, i in special.items()},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    stop_ids = stop_token_ids(get_field(reader, "general.architecture"), tokens, special["eos"],
                              *(get_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")))
    generation_config = {
        "bos_token_id": special["bos"],
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        "pad_token_id": special["pad"],
    }
    tokenizer = build_tokenizer(reader, model, tokens, special, add_bos, add_eos)
    return GGUFCheckpoint(hf_config, tokenizer.to_str(), tokenizer_config, generation_config)


# ---------------------------------------------------------------------------------------------- tensors


def _hf_names(gguf_name: str, arch: str, experts: int) -> list[str]:
    """The Hugging Face names of a GGUF tensor: one, or one per expert of a stacked expert tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    global_tensors = {**_GLOBAL_TENSORS, **_ARCH_GLOBAL_TENSORS.get(arch, {})}
    if base in global_tensors:
        return [f"{global_tensors[base]}.{suffix}"]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] == KV_B_SPLIT[1]:
        return []  # read with attn_k_b
    if match and match[2] in _EXPERT_TENSORS:
        part = _EXPERT_TENSORS[match[2]]
        return [f"model.layers.{match[1]}.mlp.experts.{e}.{part}.{match[3]}" for e in range(experts)]
    layer_tensors = _GEMMA_LAYER_TENSORS if arch in GEMMA else _LAYER_TENSORS
    hf = _ARCH_LAYER_TENSORS.get(arch, {}).get(match[2], layer_tensors.get(match[2])) if match else None
    if hf:
        return [f"model.layers.{match[1]}.{hf}.{match[3]}".replace(*_CORRECTION_BIAS)]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that folio knows")


def _weights(reader: GGUFReader, hf_config: dict) -> Iterator[ReaderTensor]:
    """The file's tensors that are the model's weights: not the RoPE factors folded into the config, nor the blocks
    after the decoder's (GLM-4.5's multi-token-prediction layers, which its block count includes)."""
    layers = hf_config["num_hidden_layers"]
    for t in reader.tensors:
        block = _BLOCK.match(t.name)
        if t.name not in _NOT_WEIGHTS and (block is None or int(block[1]) < layers):
            yield t


def _dequantized(t: ReaderTensor) -> torch.Tensor:
    # F32 tensors come back as read-only views of the file mapping; torch wants writable memory.
    return torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), requirements="W"))


def _kv_b_proj(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj [heads * (nope + v_head_dim), kv_lora_rank] from llama.cpp's halves of it: attn_k_b
    [heads, kv_lora_rank, nope] (each head's W_UK transposed) and attn_v_b [heads, v_head_dim, kv_lora_rank]."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half layout), per head."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(reader: GGUFReader, hf_config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantise, rename and un-permute every weight. Tied embeddings stay single: no lm_head.weight."""
    return dict(_iter_tensors(reader, hf_config, dtype, frozenset()))


def _tensor_types(reader: GGUFReader, hf_config: dict) -> dict[str, GGMLQuantizationType]:
    """Hugging Face name -> GGUF type of every weight of the file (hf_config: its config)."""
    arch, experts = _architecture(reader), num_experts(hf_config)
    return {name: t.tensor_type for t in _weights(reader, hf_config) for name in _hf_names(t.name, arch, experts)}


def _iter_tensors(reader: GGUFReader, hf_config: dict, dtype: torch.dtype, keep_quantized: frozenset[str]):
    """(Hugging Face name, tensor) for every weight, dequantised to dtype, except that those named in
    keep_quantized come as their blocks (folio.loader.gguf_native.GGUFBlocks, rows un-permuted likewise); MXFP4
    ones as two uint8 tensors, NAME (the codes) and NAME_scale (the scales), repacked into the MXFP4 method's
    format (folio.models.mxfp4_linear), whose weight loaders take a checkpoint's tensors."""
    from folio.loader.gguf_native import GGUFBlocks, mxfp4_from_ggml  # (their methods import the kernels' builds)

    for t in _weights(reader, hf_config):  # fail before spending seconds dequantising the rest
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which folio cannot dequantise; "
                f"supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))}"
            )
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    permuted = heads if hf_config["model_type"] in PERMUTED_QK else {}  # llama.cpp permutes llama's Q/K only
    arch, experts = _architecture(reader), num_experts(hf_config)
    tensors = {t.name: t for t in reader.tensors}
    for t in _weights(reader, hf_config):
        names = _hf_names(t.name, arch, experts)
        if not names:
            continue
        layer_tensor = _LAYER_NAME.fullmatch(t.name)
        n_head = permuted.get(layer_tensor[2]) if layer_tensor else None
        if names[0] in keep_quantized:
            blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            blocks = (blocks if n_head is None else _unpermute(blocks, n_head)).numpy()
            for name, part in zip(names, blocks.reshape(len(names), -1, blocks.shape[-1])):
                if t.tensor_type == Q.MXFP4:
                    codes, scales = mxfp4_from_ggml(part)
                    yield name, codes
                    yield f"{name}_scale", scales
                else:
                    yield name, GGUFBlocks(t.tensor_type, part)
            continue
        w = _dequantized(t)
        if n_head is not None:
            w = _unpermute(w, n_head)
        if arch in GEMMA_NORMS and t.name.endswith("norm.weight"):  # stored as 1 + weight; norms stay float32
            yield names[0], w.float() - 1.0
            continue
        if layer_tensor and layer_tensor[2] == KV_B_SPLIT[0]:
            w = _kv_b_proj(w, _dequantized(tensors[t.name.replace(*KV_B_SPLIT)]))
        if w.dim() == 1 and (t.name.endswith("ffn_gate_inp_shexp.weight")
                             or (arch == "ernie4_5-moe" and t.name.endswith("exp_probs_b.bias"))):
            w = w.unsqueeze(0)  # llama.cpp drops the unit dim of Qwen2-MoE's shared gate and ERNIE's bias
        if layer_tensor and layer_tensor[2] == "shortconv.conv":
            w = w.unsqueeze(1)  # and the middle one of LFM2's kernels, Conv1d's [channels, 1, taps]
        out_dtype = torch.float32 if t.name.endswith(_FLOAT32_TENSORS.get(arch, ())) else dtype
        for name, part in zip(names, w if len(names) > 1 else [w]):  # stacked experts (weights or biases): by dim 0
            yield name, torch.empty(part.shape, dtype=out_dtype).copy_(part)  # one copy: contiguous, in its dtype


# ------------------------------------------------------------------------------------------------ cache


def _cache_dir(path: str, kind: str) -> str:
    """The cache folder of a file's conversion of a kind (the dtype it is dequantised to, and what else)."""
    st = os.stat(path)
    key = f"{_CACHE_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{kind}"
    name = f"{os.path.basename(path).removesuffix('.gguf')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return str(envs.cache_dir() / "gguf" / name)


def _write_cache(cache_dir: str, checkpoint: GGUFCheckpoint, tensors: dict[str, torch.Tensor],
                 extra: Optional[dict[str, str]] = None) -> None:
    """Write the folder under a temporary name and rename it into place once complete."""
    parent = os.path.dirname(cache_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(cache_dir)}.tmp-", dir=parent)
    try:
        texts = {
            "config.json": json.dumps(checkpoint.hf_config, indent=2),
            "generation_config.json": json.dumps(checkpoint.generation_config, indent=2),
            "tokenizer.json": checkpoint.tokenizer_json,
            "tokenizer_config.json": json.dumps(checkpoint.tokenizer_config, indent=2),
            **(extra or {}),
        }
        for file, text in texts.items():
            with open(os.path.join(tmp, file), "w", encoding="utf-8") as f:
                f.write(text)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, cache_dir)
        except OSError:
            if not os.path.isdir(cache_dir):  # else another process finished the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _try_write_cache(cache_dir: str, checkpoint: GGUFCheckpoint, tensors: dict[str, torch.Tensor],
                     extra: Optional[dict[str, str]] = None) -> None:
    try:
        _write_cache(cache_dir, checkpoint, tensors, extra)
    except OSError as e:  # a cache we cannot write only costs speed next time
        logger.warning("could not cache the converted GGUF in %s: %s", cache_dir, e)


def _read_text(cache_dir: str, file: str) -> str:
    with open(os.path.join(cache_dir, file), encoding="utf-8") as f:
        return f.read()


def _read_cache(cache_dir: str) -> tuple[GGUFCheckpoint, dict[str, torch.Tensor]]:
    def read(file: str) -> str:
        return _read_text(cache_dir, file)

    checkpoint = GGUFCheckpoint(
        hf_config=json.loads(read("config.json")),
        tokenizer_json=read("tokenizer.json"),
        tokenizer_config=json.loads(read("tokenizer_config.json")),
        generation_config=json.loads(read("generation_config.json")),
    )
    return checkpoint, load_file(os.path.join(cache_dir, "model.safetensors"))  # memory-mapped, so instant
