"""Load a llama.cpp GGUF file as a Hugging Face-shaped checkpoint: config dict, tokenizer.json, weights.

The engine has one model path, written against Hugging Face names and config.json fields. So a GGUF is
translated into that shape here, and nothing downstream needs to know the weights came from llama.cpp.
What the translation has to undo:

* names: llama.cpp's `blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`;
* values: quantised blocks are dequantised (with the `gguf` package, the same code transformers uses);
* layout: llama.cpp's converter permutes the rows of Q and K of llama-architecture models so its
  rotary embedding can rotate adjacent pairs; Hugging Face rotates the two halves of each head;
* the tokenizer: a GGUF stores vocabulary, merges and token types as metadata, not a tokenizer.json,
  so one is rebuilt with the `tokenizers` library, splitting text the way llama.cpp does.

Dequantising takes seconds, so `load_gguf_cached` keeps the converted result as safetensors + json
files laid out like a Hugging Face model folder, and later loads memory-map them instead.
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
from typing import Any, Callable, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> Hugging Face architecture and model_type. Mistral GGUFs are written as
# "llama" by llama.cpp (gguf has no plain "mistral" architecture), so they load as Llama, as in transformers.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
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
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ rope scaling factors: folded into hf_config's rope_scaling, not a model weight.
ROPE_FREQS = "rope_freqs.weight"

# Bumped whenever the conversion changes, so stale caches are not reused.
_CACHE_VERSION = 1


@dataclass
class GGUFCheckpoint:
    """Everything but the weights, in the shapes of a Hugging Face folder's json files."""

    hf_config: dict  # config.json: parses with ModelConfig.from_hf_dict
    tokenizer_json: str  # tokenizer.json: loads with tokenizers.Tokenizer.from_str
    tokenizer_config: dict  # tokenizer_config.json: chat_template, special tokens, add_bos_token
    generation_config: dict  # generation_config.json: bos/eos(/pad) token ids


def read_gguf(path: str) -> GGUFCheckpoint:
    """Config, tokenizer and generation settings of a GGUF file, without dequantising its weights."""
    return _checkpoint(_open(path))


def load_gguf_tensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file under its Hugging Face name, dequantised to `dtype`."""
    reader = _open(path)
    return _tensors(reader, _hf_config(reader), dtype)


def load_gguf_cached(path: str, dtype: torch.dtype) -> tuple[GGUFCheckpoint, dict[str, torch.Tensor]]:
    """`read_gguf` + `load_gguf_tensors`, converted once and then read back from a cache folder.

    The cache key covers the file's absolute path, size and mtime and the dtype, so an edited or
    replaced file is converted again. The folder appears with a single rename once it is complete,
    so a crash mid-write leaves at most an ignored temporary folder, never a half cache.
    """
    _check_exists(path)
    cache_dir = _cache_dir(path, dtype)
    if os.path.isdir(cache_dir):
        return _read_cache(cache_dir)
    reader = _open(path)
    checkpoint = _checkpoint(reader)
    tensors = _tensors(reader, checkpoint.hf_config, dtype)
    try:
        _write_cache(cache_dir, checkpoint, tensors)
    except OSError as e:  # a cache we cannot write only costs speed next time
        logger.warning("could not cache the converted GGUF in %s: %s", cache_dir, e)
    return checkpoint, tensors


# ---------------------------------------------------------------------------------------------- reading


def _check_exists(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")


def _open(path: str) -> GGUFReader:
    """A reader over the file, turning the many ways GGUFReader fails on bad input into one clear error."""
    _check_exists(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError, IndexError, KeyError... on damaged files
        raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt): {type(e).__name__}: {e}") from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > os.path.getsize(path):
        raise ValueError(f"{path} is truncated or corrupt: its tensors need {end} bytes, the file has fewer")
    return reader


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _need(reader: GGUFReader, key: str) -> Any:
    value = _get(reader, key)
    if value is None:
        raise ValueError(f"the GGUF file's metadata has no {key!r}")
    return value


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _architecture(reader: GGUFReader) -> str:
    arch = _get(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; folio supports {', '.join(ARCHITECTURES)}")
    return arch


def _hf_config(reader: GGUFReader) -> dict:
    arch = _architecture(reader)
    hf_arch, model_type = ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name not in tensors:
            raise ValueError(f"the GGUF file has no tensor {name!r}")
    heads = int(_need(reader, f"{arch}.attention.head_count"))
    # key_length is only written when it differs from hidden/heads (Qwen3); q's rows always tell.
    head_dim = int(_get(reader, f"{arch}.attention.key_length", int(tensors["blk.0.attn_q.weight"].shape[1]) // heads))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml order: (hidden, vocab)
        "hidden_size": int(_need(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_need(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_need(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_get(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_get(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_need(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _get(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _get(reader, "tokenizer.ggml.eos_token_id"),
    }
    rope_type = _get(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type != "none":
        config["rope_scaling"] = {"rope_type": rope_type, "factor": _f32(_need(reader, f"{arch}.rope.scaling.factor"))}
        original = _get(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    if ROPE_FREQS in tensors:
        rope_dim = int(_get(reader, f"{arch}.rope.dimension_count", head_dim))
        factors = dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        config["rope_scaling"] = _llama3_rope_scaling(factors, config["rope_theta"], rope_dim)
    return config


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


def _checkpoint(reader: GGUFReader) -> GGUFCheckpoint:
    hf_config = _hf_config(reader)
    tokens = _get(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    model = _get(reader, "tokenizer.ggml.model")
    special = {
        name: _get(reader, f"tokenizer.ggml.{key}_token_id")
        for name, key in {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}.items()
    }
    # SentencePiece files without the flag want BOS (llama.cpp's and transformers' default); BPE ones do not.
    add_bos = bool(_get(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(_get(reader, "tokenizer.ggml.add_eos_token", False))
    tokenizer_config = {
        "chat_template": _get(reader, "tokenizer.chat_template"),
        **{f"{name}_token": None if i is None else tokens[i] for name, i in special.items()},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    # llama.cpp stops generation at end-of-turn/end-of-message tokens too, not only at EOS.
    stop_ids = [special["eos"]] + [_get(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stop_ids = [i for i in dict.fromkeys(stop_ids) if i is not None]
    generation_config = {
        "bos_token_id": special["bos"],
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        "pad_token_id": special["pad"],
    }
    tokenizer = _build_tokenizer(reader, model, tokens)
    _add_special_tokens(tokenizer, reader, model, tokens, special)
    tokenizer.post_processor = _post_processor(tokens, special, add_bos, add_eos)
    return GGUFCheckpoint(hf_config, tokenizer.to_str(), tokenizer_config, generation_config)


# -------------------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level BPE vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())

# The split regexes llama.cpp applies per `tokenizer.ggml.pre` (llama-vocab.cpp), as `tokenizers` pre-tokenizers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _regex_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # Every digit on its own, then GPT-2's regex: llama.cpp's "\p{N}" + gpt2 expressions, and SmolLM's tokenizer.json.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> pre-tokenizer, grouped as llama.cpp's llama-vocab.cpp groups them. Unknown names get
# GPT-2's regex (with a warning), as in transformers.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"], _gpt2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _digits_then_gpt2),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"], lambda: _regex_then_bytes(_LLAMA3_SPLIT)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"],
                    lambda: _regex_then_bytes(_QWEN2_SPLIT)),
}
# Llama-3's tokenizer looks a whole pre-token up in the vocabulary before merging (llama.cpp's ignore_merges).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})


def _build_tokenizer(reader: GGUFReader, model: Optional[str], tokens: list[str]) -> Tokenizer:
    if model == "gpt2":
        return _byte_level_bpe(reader, tokens)
    if model == "llama":
        return _sentencepiece_bpe(reader, tokens)
    raise ValueError(
        f"unsupported GGUF tokenizer model {model!r}; "
        "folio supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
    )


def _byte_level_bpe(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) from the vocabulary and merges, split as tokenizer.ggml.pre says."""
    # Tokens the file stores as raw text rather than in the byte alphabet get respelled, as transformers does.
    vocab = {
        t if set(t) <= _BYTE_ALPHABET else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges", [])]
    pre = _get(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        logger.warning("unknown GGUF pre-tokenizer %r: splitting text with GPT-2's regex", pre)
    bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _gpt2)()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE as byte-fallback BPE, with merges recovered from the token scores (as transformers does)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = _get(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = _get(reader, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab, _merges_from_scores(vocab, dict(zip(tokens, scores))),
        unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    add_space = bool(_get(reader, "tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space else []))
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best-scored token first.

    The same order as transformers' `generate_merges`, so both tokenizers merge identically.
    """
    merges = []
    for token, score in scores.items():
        splits = ((token[:i], token[i:]) for i in range(1, len(token)))
        pairs = [(left, right, score) for left, right in splits if left in vocab and right in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    tokenizer: Tokenizer, reader: GGUFReader, model: Optional[str], tokens: list[str], special: dict[str, Optional[int]]
) -> None:
    """Make control tokens (and bos/eos/unk/pad) whole special tokens, and user-defined ones whole added tokens.

    Otherwise `<|im_start|>` in a chat prompt would be cut into `<`, `|`, `im`... In a byte-level
    vocabulary a control token spelled outside the byte alphabet is a mislabel and is skipped, as in
    transformers: adding it would create a new id beyond the model's vocabulary.
    """
    types = _get(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    spelled = (lambda t: set(t) <= _BYTE_ALPHABET) if model == "gpt2" else (lambda t: True)
    special_ids = {i for i, kind in enumerate(types) if kind == TokenType.CONTROL} | {
        i for i in special.values() if i is not None
    }
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids) if spelled(tokens[i])]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == TokenType.USER_DEFINED and i not in special_ids and spelled(t)
        ]
    )


def _post_processor(
    tokens: list[str], special: dict[str, Optional[int]], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """Add BOS/EOS when encoding exactly as the file asks, like a Hugging Face tokenizer.json does."""
    bos = [special["bos"]] if add_bos and special["bos"] is not None else []
    eos = [special["eos"]] if add_eos and special["eos"] is not None else []
    single = " ".join([*(tokens[i] for i in bos), "$A", *(tokens[i] for i in eos)])
    return processors.TemplateProcessing(
        single=single,
        pair=f"{single} {single.replace('$A', '$B:1')}",
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(bos + eos)],
    )


# ---------------------------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that folio knows")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half layout), per head."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(reader: GGUFReader, hf_config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantise, rename and un-permute every weight. Tied embeddings stay single: no lm_head.weight."""
    for t in reader.tensors:  # fail before spending seconds dequantising the rest
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which folio cannot dequantise; "
                f"supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))}"
            )
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    permuted = heads if hf_config["model_type"] == "llama" else {}  # llama.cpp permutes llama's Q/K only
    out = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = _hf_name(t.name)
        # F32 tensors come back as read-only views of the file mapping; torch wants writable memory.
        w = torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), requirements="W"))
        layer_tensor = _LAYER_NAME.fullmatch(t.name)
        if layer_tensor and layer_tensor[2] in permuted:
            w = _unpermute(w, permuted[layer_tensor[2]])
        out[name] = torch.empty(w.shape, dtype=dtype).copy_(w)  # one copy: contiguous, in dtype
    return out


# ------------------------------------------------------------------------------------------------ cache


def _cache_dir(path: str, dtype: torch.dtype) -> str:
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "folio")
    st = os.stat(path)
    key = f"{_CACHE_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    name = f"{os.path.basename(path).removesuffix('.gguf')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return os.path.join(root, "gguf", name)


def _write_cache(cache_dir: str, checkpoint: GGUFCheckpoint, tensors: dict[str, torch.Tensor]) -> None:
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


def _read_cache(cache_dir: str) -> tuple[GGUFCheckpoint, dict[str, torch.Tensor]]:
    def read(file: str) -> str:
        with open(os.path.join(cache_dir, file), encoding="utf-8") as f:
            return f.read()

    checkpoint = GGUFCheckpoint(
        hf_config=json.loads(read("config.json")),
        tokenizer_json=read("tokenizer.json"),
        tokenizer_config=json.loads(read("tokenizer_config.json")),
        generation_config=json.loads(read("generation_config.json")),
    )
    return checkpoint, load_file(os.path.join(cache_dir, "model.safetensors"))  # memory-mapped, so instant
