"""DeepSeek V2 and V3: greedy outputs and logprobs equal Transformers' (float32) on tiny random checkpoints, with
chunked prefill and preemption forced, and over two tensor-parallel ranks.

V2: queries without a low-rank bottleneck, softmax router limited to its best groups (group_limited_greedy), YaRN
with an mscale_all_dim (which sharpens the softmax as well as the rotary tables). V3: q_lora, a sigmoid router whose
correction bias chooses the experts (noaux_tc) with renormalised, scaled weights. A third checkpoint has DeepSeek's
own latent widths (kv_lora_rank 512 + qk_rope_head_dim 64: cache rows of 576) and RoPE on halves (V3's
rope_interleave: false). A test per feature shows the checkpoint could tell if folio ignored it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EOS_ID, VOCAB, hf_greedy_logprobs, write_tokenizer
from folio import LLM
from folio.attention.cpu_paged import CPUPagedAttentionBackend
from folio.models.model_config import ModelConfig
from folio.worker.kv_cache import KVCacheSpec
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_tensor_parallel import GREEDY, _assert_same, _run

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 24
LAYERS = 3  # one dense, then two of experts (first_k_dense_replace 1)

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
              initializer_range=0.2, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, tie_word_embeddings=False)
VARIANTS = {
    "v2": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 128, "mscale": 1.0,
                                                     "mscale_all_dim": 0.8})),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                    routed_scaling_factor=2.5)),
    "v3-wide-halves": ("DeepseekV3Config", dict(q_lora_rank=24, kv_lora_rank=512, qk_rope_head_dim=64,
                                                rope_interleave=False, n_group=2, topk_group=1)),
}


def build_deepseek(folder: str, variant: str, **overrides) -> str:
    import transformers

    cls_name, extra = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers[1:]:
        if hasattr(layer.mlp.gate, "e_score_correction_bias"):  # large enough to change the chosen experts
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {v: build_deepseek(str(tmp_path_factory.mktemp(f"deepseek-{v}")), v) for v in VARIANTS}


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {v: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for v, folder in folders.items()}


def _logprobs_differ(folder: str, expected: list[tuple[list[int], list[float]]]) -> bool:
    return any(logprobs[:4] != pytest.approx(hf[:4], abs=1e-3)
               for (_, logprobs), (_, hf) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected))


def _edit_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(f"{dst}/config.json"))
    json.dump({**cfg, **changes}, open(f"{dst}/config.json", "w"))
    return dst


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_greedy_matches_transformers(folders, variant):
    cfg = json.load(open(f"{folders[variant]}/config.json"))
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert_greedy_matches(folders[variant], LAYERS * row * 4 * 4)  # one row (V is K), float32, 4-token blocks


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_transformers(folders, expected, variant):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folders[variant], PROMPTS, MAX_TOKENS),
                                                            expected[variant]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_the_cache_keeps_one_latent_row_a_token(folders):
    cfg = ModelConfig.from_hf_dict(json.load(open(f"{folders['v3-wide-halves']}/config.json")))
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 576)
    assert cfg.moe.mlp_only_layers == (0,) and cfg.moe.shared_expert_intermediate_size == 32
    assert cfg.for_tensor_parallel(2).num_key_value_heads == 1  # the row is every rank's
    spec = KVCacheSpec.for_model(cfg, 16, torch.bfloat16)
    assert spec.values_are_keys and spec.bytes_per_token == LAYERS * 576 * 2  # one row a token and layer
    k, v = spec.allocate(CPUPagedAttentionBackend(), 4, torch.device("cpu"))[0]
    assert k is v


def test_the_correction_bias_and_the_yarn_softmax_scale_matter(folders, expected, tmp_path):
    unbiased = shutil.copytree(folders["v3"], tmp_path / "unbiased")
    tensors = load_file(f"{unbiased}/model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, f"{unbiased}/model.safetensors", metadata={"format": "pt"})
    assert _logprobs_differ(str(unbiased), expected["v3"])
    rope = json.load(open(f"{folders['v2']}/config.json"))["rope_parameters"]
    plain_scale = _edit_config(folders["v2"], str(tmp_path / "no-mscale"),
                               rope_parameters={**rope, "mscale_all_dim": 0, "mscale": 0})
    assert _logprobs_differ(plain_scale, expected["v2"])


def test_multi_token_prediction_layers_are_skipped(folders, expected, tmp_path):
    folder = shutil.copytree(folders["v3"], tmp_path / "with-mtp")
    tensors = load_file(f"{folder}/model.safetensors")
    tensors[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.zeros(64, 128)  # V3's layer after the decoder's
    tensors[f"model.layers.{LAYERS}.enorm.weight"] = torch.ones(64)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    assert [t for t, _ in greedy_logprobs(str(folder), PROMPTS, MAX_TOKENS)] == [t for t, _ in expected["v3"]]


def test_unsupported_routing_is_refused(folders, tmp_path):
    for field, value in (("topk_method", "random"), ("scoring_func", "relu"), ("moe_layer_freq", 2)):
        folder = _edit_config(folders["v3"], str(tmp_path / field), **{field: value})
        with pytest.raises(ValueError, match=field):
            LLM(folder, dtype="float32", kv_cache_memory=1 << 22)


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_two_ranks_give_one_ranks_greedy_tokens(folders, variant):
    _assert_same(_run(folders[variant], GREEDY, 1), _run(folders[variant], GREEDY, 2))

