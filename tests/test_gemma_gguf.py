"""GGUF files of the gemma, gemma2 and gemma3 architectures, written from tiny Hugging Face models the way llama.cpp's
convert_hf_to_gguf.py writes them (norms stored as 1 + weight, its tensor names, its metadata, a SentencePiece
tokenizer without a space prefix that adds BOS), generate what Transformers generates from the Hugging Face
model (float32), with chunked prefill and preemption forced and prompts longer than the sliding window.

Matrices are stored as Q8_0 (or F32): the Hugging Face oracle holds the same dequantised values, so both
sides compute with identical weights.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from conftest import VOCAB, hf_greedy, write_tokenizer
from folio import LLM, SamplingParams
from folio.loader.gguf_loader import read_gguf
from folio.models.model_config import ModelConfig
from test_gemma import COMMON, CONFIGS, PROMPTS, tight_cache_memory

Q = gguf.GGMLQuantizationType
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm"}
# Gemma 1's two norms a layer are Llama's: post_attention_layernorm is the one before the MLP
_GEMMA1_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
ARCHS = {"gemma": "gemma", "gemma2": "gemma2"}  # the test model's llama.cpp architecture; else gemma3


def _hf_config(folder: str) -> ModelConfig:
    with open(os.path.join(folder, "config.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))


pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")


def _gguf_name(hf_name: str, arch: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        base, suffix = rest.rsplit(".", 1)
        return f"blk.{index}.{(_GEMMA1_LAYER_NAMES if arch == 'gemma' else _LAYER_NAMES)[base]}.{suffix}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma-like: <pad> <eos> <bos> <unk>, byte fallback, scored pieces, padded to the model's vocabulary."""
    pieces = ["▁", "t", "h", "e", "a", "i", "n", "r", "o", "s", "▁t", "he", "▁the", "in", "▁a", "er", "on",
              "▁in", "re", "▁th", "or", "st", "▁s", "▁o", "en"]
    tokens = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    while len(tokens) < VOCAB:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(gguf.TokenType.USER_DEFINED)
        scores.append(0.0)
    return tokens, scores, types


def write_gemma_gguf(folder: str, path: str, name: str, qtype: Q = Q.Q8_0, add_bos: bool = True) -> tuple[str, str]:
    """A tiny Gemma as a Hugging Face folder and as a GGUF file holding the same (dequantised) weights."""
    import transformers

    cls_name, extra = CONFIGS[name]
    # llama.cpp scales attention by 1 / sqrt(head_dim) below 27B: the scalar of every such Gemma
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, "query_pre_attn_scalar": COMMON["head_dim"]})
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    stored: dict[str, tuple[np.ndarray, Q]] = {}
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0, 0.3)
                stored[param_name] = ((param.numpy() + 1).astype(np.float32), Q.F32)  # llama.cpp: 1 + weight
            elif param.dim() == 2 and qtype != Q.F32:
                blocks = gguf.quants.quantize(param.numpy(), qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))  # the oracle's weights
                stored[param_name] = (blocks, qtype)
            else:
                stored[param_name] = (param.numpy().copy(), Q.F32)
    model.save_pretrained(folder)
    write_tokenizer(folder)

    arch = ARCHS.get(name, "gemma3")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    # Gemma 1: no window, no soft-caps, llama.cpp's default RoPE base
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(cfg.num_hidden_layers)]
        if cfg.layer_types != default:  # llama.cpp's pattern is five local layers to one global, else this key
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    tokens, scores, types = _sentencepiece_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for param_name, (data, kind) in stored.items():
        if param_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w.add_tensor(_gguf_name(param_name, arch), data, raw_dtype=None if kind == Q.F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return folder, path


@pytest.fixture(scope="module")
def gemma_ggufs(tmp_path_factory):
    files = {}
    for name in ("gemma", "gemma2", "gemma3", "gemma3-untied"):
        d = tmp_path_factory.mktemp(f"{name}-gguf")
        files[name] = write_gemma_gguf(str(d / "hf"), str(d / f"{name}.gguf"), name,
                                       Q.F32 if name in ("gemma", "gemma3-untied") else Q.Q8_0)
    return files


@pytest.fixture(scope="module")
def expected(gemma_ggufs):
    return {name: [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS] for name, (folder, _) in gemma_ggufs.items()}


@pytest.fixture(params=["cpu_paged", "torch_sdpa"])
def attention_backend(request, monkeypatch):
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "gemma3-untied"])
def test_gguf_generates_like_transformers(gemma_ggufs, expected, name, attention_backend):
    folder, path = gemma_ggufs[name]
    expected = expected[name]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7, block_size=4)
    assert llm.llm_engine.model_config.architecture == _hf_config(folder).architecture
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # preemption: a cache far too small for every request at once
    memory = tight_cache_memory(llm.llm_engine.model_config, 64, 4, 16)
    llm = LLM(path, dtype="float32", kv_cache_memory=memory, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [e[:64 - len(p)] for e, p in zip(expected, PROMPTS)]


def test_gguf_config_matches_the_hugging_face_one(gemma_ggufs):
    for name, (folder, path) in gemma_ggufs.items():
        ours = ModelConfig.from_hf_dict(read_gguf(path).hf_config)
        theirs = _hf_config(folder)
        for key in ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "sliding_windows",
                    "tie_word_embeddings", "vocab_size"):
            assert getattr(ours, key) == getattr(theirs, key), (name, key)
        gemma2_3 = ("final_logit_softcapping", "rope_local_base_freq", "query_pre_attn_scalar")
        extra = {"gemma": (), "gemma2": gemma2_3 + ("attn_logit_softcapping",)}.get(name, gemma2_3)
        for key in extra:  # Gemma 1 reads none of them
            assert ours.hf_config.get(key) == theirs.hf_config.get(key), (name, key)


def test_gguf_tokenizer_adds_bos_as_the_metadata_says(tmp_path):
    from transformers import AutoTokenizer

    for add_bos in (True, False):
        d = tmp_path / str(add_bos)
        folder, path = write_gemma_gguf(str(d / "hf"), str(d / "g.gguf"), "gemma3", Q.F32, add_bos=add_bos)
        llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
        theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        for text in ["the tin", "in the stone", " the", "héllo", "<eos> there"]:
            ids = llm.get_tokenizer().encode(text)
            assert ids == theirs.encode(text), text
            assert (ids[0] == 1) == add_bos, text


def test_gguf_native_quantized_layers(gemma_ggufs, expected):
    # quantization="gguf": the Q8_0 matrices run as stored
    folder, path = gemma_ggufs["gemma2"]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, quantization="gguf")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids[:8] for o in outs] == [e[:8] for e in expected["gemma2"]]
