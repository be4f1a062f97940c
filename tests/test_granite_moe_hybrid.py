"""Granite 4.0-H (GraniteMoeHybridForCausalLM): greedy outputs and logprobs equal Transformers' (float32) on tiny
random checkpoints of Mamba2 and attention layers, with routed experts (and RoPE) or the shared MLP alone (and NoPE,
as the released models), with chunked prefill (each request's conv and SSM states carried from chunk to chunk, the
SSD scan's blocks crossing chunks), preemption forced, and batches where some requests decode while others prefill.

Each of the Mamba2 mixer's parts has a test that fails where folio leaves it out: folio's logprobs over a prompt and
its continuation equal Transformers' forward over the whole sequence, and are far from those of the same model with
that part neutralised (D skip, dt bias, time-step limits, the gate of the gated norm, its groups, the convolution's
past inputs). A binding time_step_limit is checked against that forward, whose chunked scan clamps every token
(Transformers' one-token decode path does not: folio.models.mamba2).
"""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest
import torch

from conftest import EOS_ID, VOCAB, hf_greedy_logprobs, write_tokenizer
from folio import LLM, LLMEngine, SamplingParams
from folio.models.model_config import ModelConfig
from folio.models.recurrent_state import RecurrentStates
from greedy_match import assert_greedy_matches, greedy_logprobs

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301] * 2, [7, 8, 9]]
MAX_TOKENS = 24
LAYER_TYPES = ["mamba", "attention", "mamba", "mamba"]
KV_BLOCK = 2 * 1 * 2 * 16 * 4 * 4  # K and V, attention layers, kv heads, head_dim, fp32 bytes, block_size
CONV_DIM = 8 * 16 + 2 * 2 * 16  # x (heads * head_dim), B and C (groups * d_state each)
STATE_BYTES = 3 * (CONV_DIM * 3 + 8 * 16 * 16) * 4  # mamba layers * (conv inputs + SSM state), fp32 bytes


def build_granite_hybrid(folder: str, seed: int = 0, **overrides) -> str:
    """A 4-layer random Granite 4.0-H checkpoint (three Mamba2 layers of 8 heads in 2 groups, one attention
    layer), its mixers' scalars drawn at random so that each matters, and a tokenizer."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=LAYER_TYPES, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                  mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                  shared_intermediate_size=48, position_embedding_type="nope", embedding_multiplier=2.0,
                  residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=3.0, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GraniteMoeHybridConfig(**{**fields, **overrides}), dtype=torch.float32)
    for layer in model.model.layers:
        if layer.mamba is not None:
            mixer = layer.mamba
            for param, mean, std in ((mixer.dt_bias, 0, 1), (mixer.A_log, 0, 1), (mixer.D, 0, 2),
                                     (mixer.norm.weight, 1, 0.5), (mixer.conv1d.bias, 0, 0.5)):
                param.data.normal_(mean, std)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module", params=["experts-rope", "dense-nope"])
def granite_dir(request, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp(request.param))
    if request.param == "experts-rope":
        return build_granite_hybrid(folder, position_embedding_type="rope")
    return build_granite_hybrid(folder, num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=96)


def test_greedy_matches_transformers(granite_dir):
    assert_greedy_matches(granite_dir, KV_BLOCK, prompts=PROMPTS, state_bytes=STATE_BYTES)


def test_logprobs_match_transformers(granite_dir):
    expected = [hf_greedy_logprobs(granite_dir, p, MAX_TOKENS) for p in PROMPTS]
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(granite_dir, PROMPTS, MAX_TOKENS),
                                                            expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_decodes_beside_prefills(granite_dir, monkeypatch):
    """A request that decodes while another's prompt comes in chunks: steps of both kinds, the same tokens."""
    steps: list[list[int]] = []
    step = RecurrentStates.step

    def recorded_step(self, rows, fresh, query_lens):
        steps.append(list(query_lens))
        return step(self, rows, fresh, query_lens)

    monkeypatch.setattr(RecurrentStates, "step", recorded_step)
    engine = LLMEngine.from_kwargs(granite_dir, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine.add_request("short", {"prompt_token_ids": PROMPTS[2]}, params)
    engine.step()
    engine.step()
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert any(1 in lens and max(lens) > 1 for lens in steps)
    assert [outputs["short"], outputs["long"]] == [hf_greedy_logprobs(granite_dir, p, MAX_TOKENS)[0]
                                                   for p in (PROMPTS[2], PROMPTS[0])]


def test_released_layer_names_and_nope(tmp_path):
    """The released config.json files name their layers "mamba" and "attention" (older ones in
    layers_block_type); Transformers 5 writes "linear_attention" and "full_attention"."""
    folder = build_granite_hybrid(str(tmp_path))
    saved = json.load(open(f"{folder}/config.json"))
    assert saved["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    for key in ("layer_types", "layers_block_type"):
        released = {k: v for k, v in saved.items() if k != "layer_types"}
        cfg = ModelConfig.from_hf_dict({**released, key: LAYER_TYPES})
        assert cfg.recurrent_layers == (0, 2, 3) and cfg.kv_cache_layers == (1,)
    cfg = ModelConfig.from_hf_dict(saved)
    assert cfg.recurrent_layers == (0, 2, 3) and cfg.moe is not None and cfg.moe.shared_expert_intermediate_size == 48


def test_tensor_parallelism_is_refused(tmp_path):
    folder = build_granite_hybrid(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism is not supported for its Mamba2 layers"):
        LLM(folder, dtype="float32", kv_cache_memory=1 << 22, tensor_parallel_size=2)


# ---- each part of the mixer, against Transformers' forward over the whole sequence ----

FEATURE_PROMPTS = [list(range(30, 63)), [400, 5, 17, 260, 9, 9, 9, 120, 3, 44, 45, 46, 301]]
FEATURE_TOKENS = 10
TIME_STEP_LIMIT = (0.1, 0.6)  # binding: softplus(dt + dt_bias) falls on both sides of it here


def _disable_gate(mixer) -> None:
    forward = mixer.norm.forward
    mixer.norm.forward = lambda hidden_states, gate=None: forward(hidden_states, None)


NEUTRALISED: dict[str, Callable] = {
    "D skip": lambda mixer: mixer.D.data.zero_(),
    "dt bias": lambda mixer: mixer.dt_bias.data.zero_(),
    "time-step limits": lambda mixer: setattr(mixer, "time_step_limit", (0.0, math.inf)),
    "gate of the norm": _disable_gate,
    "groups of the norm": lambda mixer: setattr(mixer.norm, "group_size", mixer.intermediate_size),
    "convolution's past inputs": lambda mixer: mixer.conv1d.weight.data[..., :-1].zero_(),
}


@pytest.fixture(scope="module")
def feature_dir(tmp_path_factory) -> str:
    return build_granite_hybrid(str(tmp_path_factory.mktemp("granite-features")), num_local_experts=0,
                                num_experts_per_tok=0, shared_intermediate_size=96, time_step_limit=TIME_STEP_LIMIT)


@pytest.fixture(scope="module")
def folio_runs(feature_dir) -> dict[int, tuple[list[list[int]], list[list[float]]]]:
    """max_num_batched_tokens -> (each prompt with its greedy continuation, folio's logprob of each token after
    the first): chunks of 2 (fewer tokens than the convolution's state) and of 11 (across the scan's blocks of 8)."""
    params = SamplingParams(temperature=0.0, max_tokens=FEATURE_TOKENS, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    runs = {}
    for chunk in (2, 11):
        llm = LLM(feature_dir, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=chunk)
        out = [o for o in llm.generate([{"prompt_token_ids": p} for p in FEATURE_PROMPTS], params, use_tqdm=False)]
        runs[chunk] = ([o.prompt_token_ids + o.outputs[0].token_ids for o in out],
                       [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                        + [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in out])
    return runs


def _hf_logprobs(folder: str, sequences: list[list[int]], neutralise=None) -> list[list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for layer in model.model.layers:
        if layer.mamba is not None and neutralise is not None:
            neutralise(layer.mamba)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([seq]), use_cache=False).logits[0].float(), -1)[
                    torch.arange(len(seq) - 1), torch.tensor(seq[1:])].tolist() for seq in sequences]


def _max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize("feature", NEUTRALISED)
def test_each_part_of_the_mixer_counts(feature_dir, folio_runs, feature):
    for chunk, (sequences, logprobs) in folio_runs.items():
        assert _max_difference(logprobs, _hf_logprobs(feature_dir, sequences)) < 1e-4, chunk
        assert _max_difference(logprobs, _hf_logprobs(feature_dir, sequences, NEUTRALISED[feature])) > 1e-2, chunk
