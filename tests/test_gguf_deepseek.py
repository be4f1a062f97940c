"""DeepSeek V2/V3 ("deepseek2") and GLM-4.5 MoE ("glm4moe") GGUF files, written from the tiny checkpoints of
test_deepseek and test_glm4_moe as llama.cpp's converter writes them (deepseek_gguf): folio's greedy tokens and their
logprobs from the file equal Transformers' from the folder.

DeepSeek V2 (no query bottleneck, softmax router limited to its best groups, YaRN with mscale_all_dim, whose
yarn_log_multiplier must come back as the softmax's sharpening) in both of kv_b_proj's layouts: split per head into
attn_k_b / attn_v_b as newer converters write it, and whole (attn_kv_b) as older files have it; V3 (q_lora, sigmoid
router with a correction bias that chooses); GLM-4.5 with and without q/k norms, its file holding a
multi-token-prediction block after the decoder's. A Q8_0 file runs its layers as stored.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy_logprobs
from deepseek_gguf import Q, deepseek_to_gguf
from folio import LLM
from folio.loader.gguf_loader import read_gguf
from greedy_match import greedy_logprobs
from int8_weights import int8_weight
from test_deepseek import MAX_TOKENS, PROMPTS, VARIANTS, build_deepseek
from test_glm4_moe import build_glm4_moe
from test_gguf_models import _greedy

pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")

# DeepSeek's own configs have mscale == mscale_all_dim (0.707 for V2, 1.0 for V3), which llama.cpp assumes: the rotary
# tables keep their scale. The V2 test checkpoint sharpens the softmax by mscale_all_dim 0.8 likewise.
_V2_ROPE = {**VARIANTS["v2"][1]["rope_parameters"], "mscale": 0.8, "mscale_all_dim": 0.8}
CHECKPOINTS = {"v2": lambda folder: build_deepseek(folder, "v2", rope_parameters=_V2_ROPE),
               "v3": lambda folder: build_deepseek(folder, "v3"),
               "glm4moe": lambda folder: build_glm4_moe(folder, qk_norm=False),
               "glm4moe-qk-norm": lambda folder: build_glm4_moe(folder, qk_norm=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {name: build(str(tmp_path_factory.mktemp(name))) for name, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in folders.items()}


def _assert_logprobs_match(path: str, expected: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(path, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize("name, split_kv_b", [("v2", True), ("v2", False), ("v3", True)])
def test_deepseek_gguf_matches_transformers(folders, expected, tmp_path, name, split_kv_b):
    path = deepseek_to_gguf(folders[name], str(tmp_path / f"{name}.gguf"), split_kv_b=split_kv_b)
    cfg = read_gguf(path).hf_config
    if name == "v2":
        assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["q_lora_rank"] is None
        assert (cfg["topk_method"], cfg["scoring_func"]) == ("group_limited_greedy", "softmax")
        assert cfg["rope_scaling"]["mscale_all_dim"] == cfg["rope_scaling"]["mscale"] == 0.8
    else:
        assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["q_lora_rank"] == 24
        assert (cfg["topk_method"], cfg["scoring_func"], cfg["routed_scaling_factor"]) == ("noaux_tc", "sigmoid", 2.5)
    _assert_logprobs_match(path, expected[name])


@pytest.mark.parametrize("name", ["glm4moe", "glm4moe-qk-norm"])
def test_glm4_moe_gguf_matches_transformers(folders, expected, tmp_path, name):
    path = deepseek_to_gguf(folders[name], str(tmp_path / f"{name}.gguf"))
    cfg = read_gguf(path).hf_config
    assert cfg["num_hidden_layers"] == 3  # the file's 4 blocks, less its multi-token-prediction one
    assert (cfg["partial_rotary_factor"], cfg["use_qk_norm"]) == (0.5, name.endswith("qk-norm"))
    _assert_logprobs_match(path, expected[name])


def test_q8_0_deepseek_runs_natively(folders, tmp_path):
    """Q8_0 attention projections and experts load as int8; kv_b_proj (a split attn_v_b stored Q8_0) dequantised."""
    path = deepseek_to_gguf(folders["v3"], str(tmp_path / "v3-q8_0.gguf"), layer_type=Q.Q8_0)
    native = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 22)
    layer = native.llm_engine.runner.model.layers[1]
    for linear in (layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa, layer.mlp.experts[0].down_proj):
        assert int8_weight(linear).dtype == torch.int8
    dequantised = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    assert sum(g == w for g, w in zip(_greedy(native, 8), _greedy(dequantised, 8))) >= 2
