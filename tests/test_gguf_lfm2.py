"""LFM2 ("lfm2") and LFM2-MoE ("lfm2moe") GGUF files, written from the tiny checkpoints of test_lfm2 and test_lfm2_moe
as llama.cpp's converter writes them (lfm2_gguf): folio's greedy tokens and their logprobs from the file equal
Transformers' from the folder; Q8_0 files run their layers (experts included) as stored; what llama.cpp's LFM2 files
may hold that folio does not compute (a sliding window, a gating function other than the sigmoid) is refused by name.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from conftest import hf_greedy_logprobs
from folio import LLM
from folio.loader.gguf_loader import read_gguf
from greedy_match import greedy_logprobs
from int8_weights import int8_weight
from lfm2_gguf import Q, lfm2_to_gguf
from test_gguf_models import _greedy
from test_lfm2 import MAX_TOKENS, PROMPTS, build_lfm2
from test_lfm2_moe import build_lfm2_moe

pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")

CHECKPOINTS = {"lfm2": build_lfm2, "lfm2moe": build_lfm2_moe}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {name: build(str(tmp_path_factory.mktemp(name))) for name, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in folders.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_gguf_matches_transformers(folders, expected, tmp_path, name):
    path = lfm2_to_gguf(folders[name], str(tmp_path / f"{name}.gguf"))
    cfg = read_gguf(path).hf_config
    assert cfg["layer_types"] == ["conv", "full_attention", "conv", "conv", "full_attention"]
    assert cfg["num_key_value_heads"] == 2 and cfg["conv_L_cache"] == 3
    if name == "lfm2":  # the width the converter derived (Lfm2MLP's), not derived again
        assert cfg["intermediate_size"] == 160 and not cfg["block_auto_adjust_ff_dim"]
    else:
        assert (cfg["num_dense_layers"], cfg["use_expert_bias"], cfg["norm_topk_prob"]) == (1, True, True)
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(path, PROMPTS, MAX_TOKENS),
                                                            expected[name]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_q8_0_runs_natively(folders, tmp_path, name):
    """The convolutions' projections, the attention's, the MLPs' and the experts' load as int8 blocks; the kernel and
    the router stay float."""
    path = lfm2_to_gguf(folders[name], str(tmp_path / f"{name}-q8_0.gguf"), layer_type=Q.Q8_0)
    native = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 22)
    layers = native.llm_engine.runner.model.layers
    conv, attention = layers[2], layers[1]
    linears = [conv.conv.in_proj, conv.conv.out_proj, attention.self_attn.qkv_proj]
    linears += [attention.mlp.experts[0].gate_up_proj] if name == "lfm2moe" else [attention.mlp.gate_up_proj]
    assert all(int8_weight(linear).dtype == torch.int8 for linear in linears)
    dequantised = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    assert sum(g == w for g, w in zip(_greedy(native, 8), _greedy(dequantised, 8))) >= 2


@pytest.mark.parametrize("name, extra, field", [
    ("lfm2", lambda w: w.add_sliding_window(16), "lfm2.attention.sliding_window"),
    ("lfm2", lambda w: w.add_causal_attention(False), "lfm2.attention.causal"),
    ("lfm2moe", lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX), "lfm2moe.expert_gating_func"),
])
def test_what_folio_does_not_compute_is_refused(folders, tmp_path, name, extra, field):
    path = lfm2_to_gguf(folders[name], str(tmp_path / f"{name}.gguf"), extra_metadata=extra)
    with pytest.raises(ValueError, match=field):
        read_gguf(path)
