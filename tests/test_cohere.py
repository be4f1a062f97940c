"""Cohere (Command-R, Command R+) and Cohere 2 (Command R7B): greedy outputs and logprobs equal Transformers' (float32)
on tiny random models, with chunked prefill and preemption forced, over two tensor-parallel ranks, and from GGUF files
of llama.cpp's "command-r" and "cohere2" architectures.

  * command-r: logits times 0.0625 (a power of two: greedy decoding takes the head's own argmax);
  * command-r-plus: per-head q/k LayerNorms, logits times 0.8333 (Command R+'s: greedy decoding takes the argmax of
    the scaled logits), and q/k/v/o biases;
  * cohere2: an 8-token window on layers 0-2, which rotate q and k, and a global layer 3 with no positional encoding,
    logits times 0.25 (Command R7B's).

The norms' weights and the biases, which Transformers initialises to 1 and 0, are randomised, so a per-head norm weight
or a bias that did not load would show. Each of Cohere's features must be seen to matter: the same weights computed
without it (an RMSNorm for the LayerNorm, sequential blocks, RoPE on the halves of each head, no logit scale, no q/k
norms, RoPE on the global layer, no window) give other logprobs, or the match would not show that folio computes it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import pytest
import torch
import transformers
from transformers.models.cohere import modeling_cohere

from conftest import build_tiny_model, hf_greedy_logprobs
from folio.loader.gguf_loader import read_gguf
from folio.models import cohere, cohere2
from folio.models.layers import InterleavedRotaryEmbedding, RotaryEmbedding
from folio.models.llama import LlamaAttention, StepContext
from folio.models.model_config import ModelConfig
from folio.models.smollm3 import NoRotary
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_glm4 import _randomise_biases_and_norms
from test_gguf_models import hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 32
# name -> (conftest architecture, overrides, llama.cpp architecture)
VARIANTS = {
    "command-r": ("cohere", {}, "command-r"),
    "command-r-plus": ("cohere", {"use_qk_norm": True, "logit_scale": 0.8333, "attention_bias": True}, "command-r"),
    "cohere2": ("cohere2", {"logit_scale": 0.25}, "cohere2"),
}
KV_BLOCK = {"command-r": 2 * 2 * 2 * 16 * 4 * 4,  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
            "command-r-plus": 2 * 2 * 2 * 16 * 4 * 4, "cohere2": 2 * 4 * 2 * 16 * 4 * 4}


@pytest.fixture(scope="module")
def cohere_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: _randomise_biases_and_norms(build_tiny_model(str(tmp_path_factory.mktemp(name)), arch, tie=True,
                                                               **overrides))
            for name, (arch, overrides, _) in VARIANTS.items()}


@pytest.fixture(scope="module")
def expected(cohere_dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in cohere_dirs.items()}


def _assert_logprobs_match(folder: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(cohere_dirs, name):
    assert_greedy_matches(cohere_dirs[name], KV_BLOCK[name])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logprobs_match_transformers(cohere_dirs, expected, name):
    _assert_logprobs_match(cohere_dirs[name], expected[name])


def test_cohere2_layers(cohere_dirs):
    from folio import LLM

    llm = LLM(cohere_dirs["cohere2"], dtype="float32", kv_cache_memory=1 << 22)
    assert llm.llm_engine.model_config.sliding_windows == (8, 8, 8, None)
    layers = llm.llm_engine.runner.model.layers
    assert [isinstance(layer.self_attn.rotary, NoRotary) for layer in layers] == [False, False, False, True]


def test_interleaved_rotary_equals_transformers():
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 9
    config = transformers.CohereConfig(hidden_size=64, num_attention_heads=heads, max_position_embeddings=64,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 7, 8, 30, 31, 62, 63])
    cos, sin = modeling_cohere.CohereRotaryEmbedding(config)(qkv, positions[None])
    q, k = qkv[:, :heads].transpose(0, 1)[None], qkv[:, heads:heads + kv_heads].transpose(0, 1)[None]
    want_q, want_k = modeling_cohere.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = InterleavedRotaryEmbedding(head_dim, 64, 500.0, None)(
        positions, *qkv.clone().split_with_sizes([heads, kv_heads, kv_heads], 1)[:2])
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


# Each leaves a feature out, by a monkeypatch or in a copy of the folder (in tmp_path), and gives the folder to run.

def _rms_norm(monkeypatch, folder: str, tmp_path) -> str:
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # no mean subtracted
        h = x.float()
        return (self.weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
    monkeypatch.setattr(cohere.CohereLayerNorm, "forward", forward)
    return folder


def _sequential_block(monkeypatch, folder: str, tmp_path) -> str:
    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.input_layernorm(x))
    monkeypatch.setattr(cohere.CohereDecoderLayer, "forward", forward)
    return folder


def _neox_rope(monkeypatch, folder: str, tmp_path) -> str:
    monkeypatch.setattr(cohere.CohereForCausalLM, "rotary_cls", RotaryEmbedding)
    return folder


def _no_qk_norm(monkeypatch, folder: str, tmp_path) -> str:
    monkeypatch.setattr(cohere.CohereAttention, "normalize_qk", LlamaAttention.normalize_qk)
    return folder


def _rope_everywhere(monkeypatch, folder: str, tmp_path) -> str:
    monkeypatch.setattr(cohere2, "rope_layers", lambda cfg: [True] * cfg.num_hidden_layers)
    return folder


def _config_copy(**changes) -> Callable[..., str]:
    def copy(monkeypatch, folder: str, tmp_path) -> str:
        into = shutil.copytree(folder, tmp_path / "changed")
        cfg = json.load(open(into / "config.json"))
        json.dump({**cfg, **changes}, open(into / "config.json", "w"))
        return str(into)
    return copy


FEATURES = {
    "layer-norm": ("command-r", _rms_norm),
    "parallel-block": ("command-r", _sequential_block),
    "interleaved-rope": ("command-r", _neox_rope),
    "logit-scale": ("command-r", _config_copy(logit_scale=1.0)),
    "qk-norm": ("command-r-plus", _no_qk_norm),
    "nope-global-layer": ("cohere2", _rope_everywhere),
    # a window no shorter than the context: full attention, the same layers rotating
    "sliding-window": ("cohere2", _config_copy(sliding_window=4096)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_matters(cohere_dirs, expected, feature, monkeypatch, tmp_path):
    name, leave_out = FEATURES[feature]
    folder = leave_out(monkeypatch, cohere_dirs[name], tmp_path)
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected[name]):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


class _FixedHead(torch.nn.Module):
    """An lm_head whose logits are given, with the head's own argmax."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.argmax(-1)


BASE = {"architectures": ["CohereForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1}


@pytest.mark.parametrize("scale, token", [(0.0625, 1), (0.8333, 0)])
def test_greedy_takes_the_scaled_logits_argmax(scale, token):
    """Two logits a float apart, which 0.8333 rounds to a tie (Transformers' greedy then picks the first) and 0.0625
    keeps apart."""
    model = cohere.CohereForCausalLM(ModelConfig.from_hf_dict({**BASE, "logit_scale": scale}), 16)
    a = torch.tensor(1.5000005960464478)
    model.lm_head = _FixedHead(torch.stack([a, torch.nextafter(a, torch.tensor(2.0))])[None])
    hidden = torch.zeros(1, 8)
    assert model.exact_scale == (scale == 0.0625)
    assert model.compute_greedy_tokens(hidden).tolist() == model.compute_logits(hidden).argmax(-1).tolist() == [token]


def test_config_defaults():
    hf = ModelConfig.from_hf_dict(BASE)  # Transformers' CohereConfig: its RoPE base, LayerNorm epsilon, scale, tying
    assert (hf.rope_theta, hf.tie_word_embeddings, hf.hf_config["layer_norm_eps"], hf.hf_config["logit_scale"]) == \
        (500_000.0, True, 1e-5, 0.0625)
    stated = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 8e6}}  # Transformers 5's form
    assert ModelConfig.from_hf_dict(stated).rope_theta == 8e6
    # Transformers' Cohere2Config: a RoPE base of 10000, a window of 4096 on three layers of every four, which rotate
    base2 = {**BASE, "architectures": ["Cohere2ForCausalLM"], "num_hidden_layers": 8, "max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf_dict(base2)
    assert cfg.rope_theta == 10000.0 and cfg.sliding_windows == (4096, 4096, 4096, None) * 2
    assert cohere2.rope_layers(cfg) == [True, True, True, False] * 2
    # a window no shorter than the context attends to everything; the sliding layers still rotate, as Transformers'
    cfg = ModelConfig.from_hf_dict({**base2, "sliding_window": 8192})
    assert cfg.sliding_windows == () and cohere2.rope_layers(cfg) == [True, True, True, False] * 2
    # no window: every layer global, and none rotates (Transformers' Cohere2 rotates the sliding layers only)
    cfg = ModelConfig.from_hf_dict({**base2, "sliding_window": None})
    assert cfg.sliding_windows == () and cohere2.rope_layers(cfg) == [False] * 8


@pytest.mark.parametrize("arch, changes, message", [
    ("CohereForCausalLM", {"logit_scale": 0}, "logit_scale must be positive, got 0.0"),
    ("CohereForCausalLM", {"logit_scale": None}, "logit_scale must be a number, got None"),
    ("CohereForCausalLM", {"layer_norm_eps": None}, "layer_norm_eps must be a number, got None"),
    ("CohereForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ("CohereForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("Cohere2ForCausalLM", {"use_qk_norm": True}, "use_qk_norm is not supported"),
    ("Cohere2ForCausalLM", {"head_dim": 16}, "head_dim 16 is not supported"),
    ("Cohere2ForCausalLM", {"rotary_pct": 0.5}, "rotary_pct 0.5 is not supported"),
])
def test_refuses_what_it_does_not_compute(arch, changes, message):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], **changes})
    model_cls = cohere.CohereForCausalLM if arch == "CohereForCausalLM" else cohere2.Cohere2ForCausalLM
    with pytest.raises(ValueError, match=message):
        model_cls(cfg, 16)


@pytest.mark.parametrize("name", ["command-r-plus", "cohere2"])
def test_two_ranks_give_one_ranks_greedy_tokens(cohere_dirs, name):
    """Each rank normalises its heads of q and k with its rows of the per-head weights."""
    folder = cohere_dirs[name]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


@pytest.mark.usefixtures("isolated_gguf_cache")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gguf_generates_like_transformers(cohere_dirs, expected, name, tmp_path):
    # llama.cpp's converter keeps Cohere's Q and K rows as they are (its "normal" RoPE rotates interleaved pairs)
    path = hf_to_gguf(cohere_dirs[name], str(tmp_path / f"{name}.gguf"), VARIANTS[name][2])
    theirs = json.load(open(os.path.join(cohere_dirs[name], "config.json")))
    assert _facts(ModelConfig.from_hf_dict(read_gguf(path).hf_config)) == _facts(ModelConfig.from_hf_dict(theirs))
    _assert_logprobs_match(path, expected[name])


def _facts(cfg: ModelConfig) -> tuple:
    """What a GGUF file must carry over of a Cohere config."""
    hf = cfg.hf_config
    return (cfg.architecture, cfg.sliding_windows, cfg.rope_theta, cfg.tie_word_embeddings, cfg.attention_bias,
            hf["layer_norm_eps"], hf["logit_scale"], bool(hf.get("use_qk_norm")))
