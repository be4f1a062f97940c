"""Mixture of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE): greedy outputs equal Transformers'
with chunked prefill and preemption, and a step runs each chosen expert once on all of its tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_logprobs
from folio import LLM, SamplingParams
from greedy_match import assert_greedy_matches
from int8_weights import int8_weight

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model_factory, arch):
    assert_greedy_matches(tiny_model_factory(arch), KV_BLOCK)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_chosen_expert_runs_once_per_step(tiny_model_factory, arch):
    from folio.models.fused_moe import FusedExpertsMethod

    llm = LLM(tiny_model_factory(arch), dtype="float32", kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    block = model.layers[0].mlp
    assert isinstance(block.experts.method, FusedExpertsMethod)  # unquantised experts run fused
    before = block.experts.runs.clone()
    x = torch.randn(64, model.config.hidden_size)
    with torch.no_grad():
        out = block(x)
    chosen = set(block.gate(x)[1].flatten().tolist())
    assert (block.experts.runs - before).tolist() == [int(e in chosen) for e in range(block.experts.num_experts)]
    with torch.no_grad():  # token by token gives the same numbers
        alone = torch.cat([block(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(out, alone, rtol=1e-4, atol=1e-5)


# mean |logprob error| bounds of test_quantization's tiny models: int8 quantises the activations too
@pytest.mark.parametrize("scheme,bound", [("w8a16", 0.05), ("int8", 0.12)])
def test_moe_quantised_stays_close(tiny_model_factory, scheme, bound):
    from folio.models.experts_method import PerExpertMethod

    folder = tiny_model_factory("qwen2_moe")
    llm = LLM(folder, dtype="float32", quantization=scheme, kv_cache_memory=1 << 22)
    experts = llm.llm_engine.runner.model.layers[0].mlp.experts
    assert int8_weight(experts[0].down_proj).dtype == torch.int8 and isinstance(experts.method, PerExpertMethod)
    prompt = list(range(30, 60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
    want = hf_logprobs(folder, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert float((got - want).abs().mean()) < bound


def test_step_profile_shows_each_expert_read_once_per_step(tiny_model_factory):
    from folio.bench.step_profile import profile_steps

    llm = LLM(tiny_model_factory("qwen3_moe"), dtype="float32", kv_cache_memory=1 << 22)
    with profile_steps(llm.llm_engine) as profile:
        llm.generate([{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(3, 67)],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    decode = profile.breakdown().decode
    assert decode.num_steps and decode.max_runs_per_expert == 1
    assert decode.mean_expert_runs <= 2 * 8  # two layers of eight experts


def test_moe_config_without_experts_is_named():
    from folio.models.model_config import ModelConfig
    from folio.models.registry import build_model

    cfg = ModelConfig.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM is a mixture of experts, but its config has no"):
        build_model(cfg, 16)
