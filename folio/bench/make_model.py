"""Random-weight Hugging Face model folders of the architectures the benchmarks use.

Speed depends on shapes and dtype, not on what the weights learned, and nothing may be downloaded here; so a
benchmark model is the real architecture with random weights. This writes the folder directly (config.json,
generation_config.json, model.safetensors in bfloat16 with normal(0, 0.02) weights and unit norms,
tokenizer.json, tokenizer_config.json with a ChatML template) in seconds, without transformers. The tokenizer is
a byte-level BPE trained on the shipped chat prompts, padded with filler words to the model's vocabulary so that
every id the model can emit decodes; the special tokens take the last ids.

    folio bench make-model --arch qwen2-0.5b --out models/qwen2-0.5b-random
    folio bench make-model --arch qwen2-0.5b --set num_hidden_layers=2 --set vocab_size=1024 --out /tmp/tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any, Iterator

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from folio.bench.workload import DATASETS

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Qwen2(.5)-0.5B: the model of the performance study's W1 workload
    "qwen2-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                   "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
                   "use_sliding_window": False},
    # SmolLM2-135M: the embedded default model's architecture, as a plain bf16 folder
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "hidden_act": "silu"},
}
# A small Qwen3-MoE (16 experts of 768, 2 per token) and the dense Qwen3 of its active size (one MLP of 2 x 768):
# an MoE decode step against the dense one's.
_SMALL_QWEN3 = {"hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
                "head_dim": 64, "vocab_size": 16384, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}
ARCHITECTURES.update({
    "qwen3-moe-small": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_SMALL_QWEN3,
                        "intermediate_size": 1536, "num_experts": 16, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 768, "norm_topk_prob": True},
    "qwen3-moe-small-dense": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_SMALL_QWEN3,
                              "intermediate_size": 1536},
})
# DeepSeek-V2-Lite (16B, 2.4B active): latent attention, 64 experts of 1408 (6 a token) and 2 shared after one dense
# layer; benchmarks take a few of its 27 layers (--set num_hidden_layers=4: 2.6B parameters)
ARCHITECTURES["deepseek-v2-lite"] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TRAINED_VOCAB = 8192  # BPE merges learnt from the corpus; the rest of the vocabulary is filler
INIT_STD = 0.02
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), required=True, help="architecture to build")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write (created; files overwritten)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a config.json field, VALUE as JSON (e.g. num_hidden_layers=2); repeatable")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default: 0)")


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string
    return overrides


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Llama-family checkpoint (Qwen2 adds q/k/v biases, Qwen3 q/k norms, Qwen3-MoE
    experts and a router in place of the MLP, DeepSeek V2 latent attention and experts after its dense layers; tied
    models have no lm_head)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        shapes.update(_attention_shapes(cfg, p + "self_attn."))
        shapes.update(_mlp_shapes(cfg, p + "mlp.", i))
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _attention_shapes(cfg: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["model_type"] == "deepseek_v2":  # latent attention, without a query bottleneck (V2-Lite)
        rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        return {p + "q_proj.weight": (heads * (nope + rope), h), p + "kv_a_proj_with_mqa.weight": (rank + rope, h),
                p + "kv_a_layernorm.weight": (rank,), p + "kv_b_proj.weight": (heads * (nope + v), rank),
                p + "o_proj.weight": (h, heads * v)}
    kv_heads = cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    shapes = {p + "q_proj.weight": (heads * d, h), p + "k_proj.weight": (kv_heads * d, h),
              p + "v_proj.weight": (kv_heads * d, h), p + "o_proj.weight": (h, heads * d)}
    if cfg["model_type"] == "qwen2":
        shapes.update({p + "q_proj.bias": (heads * d,), p + "k_proj.bias": (kv_heads * d,),
                       p + "v_proj.bias": (kv_heads * d,)})
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return shapes


def _mlp_shapes(cfg: dict[str, Any], p: str, layer: int) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts")
    if not experts or layer < cfg.get("first_k_dense_replace", 0):
        inter = cfg["intermediate_size"]
        return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h),
                p + "down_proj.weight": (h, inter)}
    e_inter = cfg["moe_intermediate_size"]
    shapes = {p + "gate.weight": (experts, h)}
    if cfg.get("n_shared_experts"):  # DeepSeek's shared experts: one MLP of their summed width
        shapes.update({p + "shared_experts.gate_proj.weight": (cfg["n_shared_experts"] * e_inter, h),
                       p + "shared_experts.up_proj.weight": (cfg["n_shared_experts"] * e_inter, h),
                       p + "shared_experts.down_proj.weight": (h, cfg["n_shared_experts"] * e_inter)})
    for e in range(experts):
        mlp = f"experts.{e}."
        shapes.update({p + mlp + "gate_proj.weight": (e_inter, h), p + mlp + "up_proj.weight": (e_inter, h),
                       p + mlp + "down_proj.weight": (h, e_inter)})
    return shapes


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = torch.empty(shape).normal_(0.0, INIT_STD, generator=generator).to(torch.bfloat16)
    return tensors


def _corpus() -> Iterator[str]:
    with open(DATASETS["chat"], encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                yield message["content"]


def _filler_tokens(taken: set[str]) -> Iterator[str]:
    """Distinct pronounceable byte-level tokens (' baba', ' babe', ...), so padding ids decode to word-like text."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    for n in itertools.count(2):
        for parts in itertools.product(syllables, repeat=n):
            token = "\u0120" + "".join(parts)  # byte-level BPE spells a leading space as U+0120
            if token not in taken:
                yield token


def build_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text: regular tokens take ids [0, vocab_size - 3), the special tokens the last three."""
    regular = vocab_size - len(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if regular < len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)} for a byte-level "
                         f"tokenizer, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(regular, TRAINED_VOCAB), initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for token in itertools.islice(_filler_tokens(set(vocab)), regular - len(vocab)):
        vocab[token] = len(vocab)
    data["added_tokens"] = [{"id": regular + i, "content": token, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, token in enumerate(SPECIAL_TOKENS)]
    return json.dumps(data, ensure_ascii=False)


def make_model(arch: str, out: str, overrides: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Write the folder; returns its config.json dict."""
    cfg = {**ARCHITECTURES[arch], **overrides}
    vocab = cfg["vocab_size"]
    special = {token: vocab - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
    endoftext, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    cfg.update(bos_token_id=endoftext, eos_token_id=im_end, torch_dtype="bfloat16")
    tokenizer_json = build_tokenizer(vocab)
    os.makedirs(out, exist_ok=True)
    save_file(_random_weights(cfg, seed), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    files = {
        "config.json": cfg,
        "generation_config.json": {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext],
                                   "pad_token_id": endoftext},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                                  "model_max_length": cfg["max_position_embeddings"], "chat_template": CHATML},
    }
    for name, content in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    return cfg


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    cfg = make_model(args.arch, args.out, _parse_overrides(args.overrides), args.seed)
    params = sum(torch.Size(s).numel() for s in weight_shapes(cfg).values())
    print(f"folio bench make-model: {args.arch} ({params / 1e6:.1f}M parameters, bfloat16) -> {args.out} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0
