"""GLM-4.5 MoE: greedy outputs and logprobs equal Transformers' (float32) on tiny random checkpoints, with and without
per-head q/k norms, with chunked prefill and preemption forced, and over two tensor-parallel ranks.

The checkpoint has q/k/v biases, a head_dim that is not hidden_size / heads, half of each head rotating (neox style),
a dense first layer, experts routed by sigmoid scores with a correction bias that changes the choice, and a shared
expert; reading its RoPE as GLM-4's (interleaved pairs) or its q/k norms as absent must change the logprobs.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import EOS_ID, VOCAB, hf_greedy_logprobs, write_tokenizer
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_tensor_parallel import GREEDY, _assert_same, _run

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2]
MAX_TOKENS = 24
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
              attention_bias=True, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=EOS_ID, pad_token_id=0, tie_word_embeddings=False)
KV_BLOCK = 2 * 3 * 2 * 32 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size


def build_glm4_moe(folder: str, qk_norm: bool) -> str:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**CONFIG, use_qk_norm=qk_norm),
                                                          dtype=torch.float32)
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias.data.normal_(0, 0.2)
        if qk_norm:
            attn.q_norm.weight.data.normal_(1, 0.5)
            attn.k_norm.weight.data.normal_(1, 0.5)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[bool, str]:
    return {qk: build_glm4_moe(str(tmp_path_factory.mktemp(f"glm4moe-{qk}")), qk) for qk in (False, True)}


@pytest.fixture(scope="module")
def expected(folders) -> dict[bool, list[tuple[list[int], list[float]]]]:
    return {qk: [hf_greedy_logprobs(folder, p, MAX_TOKENS) for p in PROMPTS] for qk, folder in folders.items()}


def _logprobs_differ(folder: str, expected: list[tuple[list[int], list[float]]]) -> bool:
    return any(logprobs[:4] != pytest.approx(hf[:4], abs=1e-3)
               for (_, logprobs), (_, hf) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_greedy_matches_transformers(folders, qk_norm):
    assert_greedy_matches(folders[qk_norm], KV_BLOCK)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_logprobs_match_transformers(folders, expected, qk_norm):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folders[qk_norm], PROMPTS, MAX_TOKENS),
                                                            expected[qk_norm]):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_rope_layout_and_qk_norms_matter(folders, expected, tmp_path, monkeypatch):
    from folio.models import glm4_moe
    from folio.models.layers import InterleavedRotaryEmbedding

    monkeypatch.setattr(glm4_moe.Glm4MoeForCausalLM, "rotary_cls", InterleavedRotaryEmbedding)  # GLM-4's pairs
    assert _logprobs_differ(folders[False], expected[False])
    monkeypatch.undo()
    without_norms = shutil.copytree(folders[True], tmp_path / "no-qk-norm")
    cfg = json.load(open(without_norms / "config.json"))
    json.dump({**cfg, "use_qk_norm": False}, open(without_norms / "config.json", "w"))
    with pytest.raises(ValueError, match="_norm.weight' has no place"):  # the norms' tensors have nowhere to go
        greedy_logprobs(str(without_norms), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_two_ranks_give_one_ranks_greedy_tokens(folders, qk_norm):
    _assert_same(_run(folders[qk_norm], GREEDY, 1), _run(folders[qk_norm], GREEDY, 2))
