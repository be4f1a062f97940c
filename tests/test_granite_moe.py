"""Granite MoE and Granite MoE with a shared MLP: greedy outputs and logprobs equal Transformers' (float32) on tiny
random models whose four Granite scalars are far from 1 (conftest's "granitemoe", "granitemoeshared"), with chunked
prefill and preemption forced; and from a GGUF file written as llama.cpp's converter writes one.

The checkpoints stack the experts (gate rows, then up rows) and fuse the shared MLP's gate and up: loading them into
the wrong halves, or leaving out the residual multiplier on the experts' sum or the shared MLP, must break the match.
Two tensor-parallel ranks give one rank's tokens (each keeps its columns of every expert and of the shared MLP).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model, hf_greedy_logprobs
from folio import LLM, SamplingParams
from folio.models.granite_moe import GraniteMoeForCausalLM
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import hf_to_gguf
from test_tensor_parallel import GREEDY, _assert_same, _run

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
MAX_TOKENS = 24
VARIANTS = ("granitemoe", "granitemoeshared")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: build_tiny_model(str(tmp_path_factory.mktemp(arch)), arch) for arch in VARIANTS}


@pytest.fixture(scope="module")
def expected(dirs) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {arch: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for arch, folder in dirs.items()}


def _assert_logprobs_differ(folder: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert logprobs[:4] != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_greedy_matches_transformers(dirs):
    assert_greedy_matches(dirs["granitemoeshared"], KV_BLOCK)


@pytest.mark.parametrize("arch", VARIANTS)
def test_logprobs_match_transformers(dirs, expected, arch):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(dirs[arch], PROMPTS, MAX_TOKENS),
                                                            expected[arch]):
        assert tokens == hf_tokens and len(set(tokens)) > 3  # a continuation, not one token repeated
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_residual_multiplier_scales_the_experts(dirs, expected, tmp_path):
    folder = shutil.copytree(dirs["granitemoeshared"], tmp_path / "unscaled")
    cfg = json.load(open(folder / "config.json"))
    cfg["residual_multiplier"] = 1.0
    json.dump(cfg, open(folder / "config.json", "w"))
    _assert_logprobs_differ(str(folder), expected["granitemoeshared"])


def test_gate_and_up_halves_are_told_apart(dirs, expected, tmp_path):
    """input_linear's halves (the experts' and the shared MLP's) swapped: what loading them the wrong way round
    would compute, which must not match."""
    folder = shutil.copytree(dirs["granitemoeshared"], tmp_path / "swapped")
    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("input_linear.weight"):
            gate, up = t.chunk(2, dim=-2)
            tensors[name] = torch.cat([up, gate], dim=-2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _assert_logprobs_differ(str(folder), expected["granitemoeshared"])


def test_shared_mlp_matters(dirs, expected, tmp_path):
    folder = shutil.copytree(dirs["granitemoeshared"], tmp_path / "no-shared")
    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("shared_mlp.output_linear.weight"):
            tensors[name] = torch.zeros_like(t)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _assert_logprobs_differ(str(folder), expected["granitemoeshared"])


def test_config_without_experts_is_named():
    cfg = ModelConfig.from_hf_dict({"architectures": ["GraniteMoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    with pytest.raises(ValueError, match="GraniteMoeForCausalLM is a mixture of experts, but its config has no "
                                         "num_local_experts"):
        GraniteMoeForCausalLM(cfg, 16)


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_gguf_generates_like_transformers(dirs, expected, tmp_path):
    """llama.cpp's "granitemoe": input_linear cut into ffn_gate_exps and ffn_up_exps (the shared MLP's into
    ffn_gate_shexp and ffn_up_shexp), Q and K permuted, the scalars as *_scale keys."""
    folder = shutil.copytree(dirs["granitemoeshared"], tmp_path / "per-expert")
    tensors = load_file(folder / "model.safetensors")
    save_file({piece_name: piece.contiguous() for name, t in tensors.items()
               for piece_name, piece in GraniteMoeForCausalLM.split_checkpoint_tensor(name, t)},
              folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(hf_to_gguf(str(folder), str(tmp_path / "granitemoe.gguf"), "granitemoe"), dtype="float32",
              kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in expected["granitemoeshared"]]


def test_two_ranks_give_one_ranks_greedy_tokens(dirs):
    _assert_same(_run(dirs["granitemoeshared"], GREEDY, 1), _run(dirs["granitemoeshared"], GREEDY, 2))
