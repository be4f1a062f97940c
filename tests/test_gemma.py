"""Gemma 1, 2 and 3 (text): greedy outputs equal Transformers' (float32) token for token, on tiny random
models whose sliding window (8 tokens) is far shorter than the prompts, with chunked prefill and preemption
forced, through both attention backends.

The tiny models make every Gemma feature count: norm weights are random (Transformers initialises them to
zero, which would hide a wrong (1 + weight) convention), Gemma 2's soft-caps are small enough to bend the
scores and logits, query_pre_attn_scalar differs from head_dim, and Gemma 3's global layers scale RoPE
linearly on another base than the local ones. Gemma 1's config.json holds the same scalar and soft-caps, which
Transformers' Gemma 1 ignores, and so must folio.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import EOS_ID, VOCAB, hf_greedy, hf_greedy_logprobs, write_tokenizer
from folio import LLM, SamplingParams
from folio.models.model_config import ModelConfig
from folio.worker.kv_cache import group_layers

WINDOW = 8
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301],
           [300] * 9, list(range(400, 433))]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS_ID,
              pad_token_id=0, initializer_range=0.2, sliding_window=WINDOW, query_pre_attn_scalar=24)
CONFIGS = {
    # no sliding_window: Transformers' cache would slide by one left in a Gemma 1 config, where its mask does not
    "gemma": ("GemmaConfig", dict(num_hidden_layers=2, sliding_window=None, attn_logit_softcapping=4.0,
                                  final_logit_softcapping=6.0)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    # untied lm_head, Gemma 3 with a layer pattern of its own and soft-capped logits (attn_logit_softcapping:
    # Transformers' Gemma 3 attention ignores it, and so must folio)
    "gemma3-untied": ("Gemma3TextConfig", dict(num_hidden_layers=4, tie_word_embeddings=False,
                                               attn_logit_softcapping=5.0, final_logit_softcapping=6.0,
                                               layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention", "sliding_attention"])),
}


def build_gemma(folder: str, name: str, seed: int = 0, **overrides) -> str:
    import transformers

    cls_name, extra = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:  # zero-initialised: make (1 + weight) matter
                param.normal_(0, 0.5)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    return {name: build_gemma(str(tmp_path_factory.mktemp(name)), name) for name in CONFIGS}


@pytest.fixture(scope="module")
def expected(gemma_dirs):
    return {name: [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS] for name, folder in gemma_dirs.items()}


@pytest.fixture(params=["cpu_paged", "torch_sdpa"])
def attention_backend(request, monkeypatch):
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", request.param)
    return request.param


def _generate(folder: str, **kwargs) -> list[list[int]]:
    llm = LLM(folder, dtype="float32", **{"kv_cache_memory": 1 << 22, **kwargs})
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(gemma_dirs, expected, name, attention_backend):
    tokens, _ = _generate(gemma_dirs[name])
    assert tokens == expected[name]


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_chunked_prefill_matches(gemma_dirs, expected, name, attention_backend):
    # 7-token chunks: prompts cross the window in pieces, after cached context, beside other requests' decodes
    tokens, _ = _generate(gemma_dirs[name], max_num_batched_tokens=7, block_size=4)
    assert tokens == expected[name]


def tight_cache_memory(cfg: ModelConfig, max_model_len: int, block_size: int, chunk: int, spare: int = 6,
                       draft_layers: int = 0) -> int:
    """KV memory for one request of max_model_len and a few blocks more (sliding groups hold their windows).
    draft_layers: those of a draft model with the same KV heads, whose K/V every block holds too."""
    groups, layers_per_block = group_layers(cfg.sliding_windows, cfg.num_hidden_layers)
    per_block = 2 * (layers_per_block + draft_layers) * cfg.num_key_value_heads * cfg.head_dim * 4 * block_size
    return (sum(g.max_blocks(max_model_len, block_size, chunk) for g in groups) + spare) * per_block


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_preemption_matches(gemma_dirs, expected, name, attention_backend):
    folder = gemma_dirs[name]
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    tokens, llm = _generate(folder, block_size=4, kv_cache_memory=tight_cache_memory(cfg, 64, 4, 16), max_model_len=64,
                            max_num_batched_tokens=16)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens == [e[:64 - len(p)] for e, p in zip(expected[name], PROMPTS)]


ORIGINAL = 32  # the original context of the RoPE-scaled models: prompts cross the window and fit it, outputs pass it
SCALED = {  # the scaling of the global layers (Gemma 3's local ones keep their default RoPE), max_position_embeddings
    "gemma3-dynamic": ("gemma3", {"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "gemma2-dynamic": ("gemma2", {"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "gemma3-yarn": ("gemma3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                    4 * ORIGINAL),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_rope_scaling_past_the_original_context(tmp_path, name):
    # the tables read the original context (dynamic's growth starts there), not the engine's max positions
    base, scaling, max_len = SCALED[name]
    rope = {**scaling, "rope_theta": 10000.0}
    if base == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {**scaling, "rope_theta": 1000000.0}}
    folder = build_gemma(str(tmp_path / name), base, max_position_embeddings=max_len, rope_parameters=rope)
    prompts, max_tokens = [list(range(20, 20 + ORIGINAL - 4)), [5, 6, 7, 8, 9]], 3 * ORIGINAL
    expected = [hf_greedy_logprobs(folder, p, max_tokens) for p in prompts]
    assert max(len(p) + len(tokens) for p, (tokens, _) in zip(prompts, expected)) > 2 * ORIGINAL
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7, block_size=4)
    assert llm.llm_engine.max_model_len == 4 * ORIGINAL
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, expected):  # the tokens barely depend on RoPE: their logprobs do
        assert out.outputs[0].token_ids == tokens
        assert [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)] == pytest.approx(logprobs, abs=1e-4)


def test_config_parsing(gemma_dirs):
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(gemma_dirs["gemma2"], "config.json"))))
    assert cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    # a Gemma 3 config.json of the older form (rope_theta / rope_local_base_freq / rope_scaling and a
    # pattern instead of layer_types), nested in a multimodal config that leaves the rest to the defaults
    old = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    cfg = ModelConfig.from_hf_dict(old)
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert cfg.hf_config["rope_local_base_freq"] == 10000.0 and cfg.tie_word_embeddings
    assert cfg.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    # gemma-7b's config.json of its time leaves tying out (Transformers' GemmaConfig ties) and no layer slides
    gemma7b = {"architectures": ["GemmaForCausalLM"], "hidden_size": 3072, "intermediate_size": 24576, "head_dim": 256,
               "num_hidden_layers": 28, "num_attention_heads": 16, "vocab_size": 256000, "hidden_act": "gelu"}
    cfg = ModelConfig.from_hf_dict(gemma7b)
    assert cfg.tie_word_embeddings and cfg.head_dim == 256 and cfg.sliding_windows == ()


def test_unsupported_configs(gemma_dirs, tmp_path):
    for key, value, match in [("use_bidirectional_attention", True, "use_bidirectional_attention"),
                              ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
                              ("layer_types", ["chunked_attention"] * 6, "chunked_attention")]:
        folder = tmp_path / key
        shutil.copytree(gemma_dirs["gemma3"], folder)
        cfg = json.load(open(folder / "config.json"))
        cfg[key] = value
        json.dump(cfg, open(folder / "config.json", "w"))
        with pytest.raises(ValueError, match=match):
            LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    # Gemma3ForConditionalGeneration (Gemma 3 4B and up): the vision tower is skipped, text generation equals
    # Transformers' on text-only input
    import transformers

    text = {**COMMON, "num_hidden_layers": 6}
    text = {k: v for k, v in text.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 3, boi_token_index=VOCAB - 2,
                                    eoi_token_index=VOCAB - 1, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and "language_model" in param_name:
                param.normal_(0, 0.5)
    folder = str(tmp_path / "gemma3-mm")
    model.save_pretrained(folder)
    write_tokenizer(folder)
    tokens, llm = _generate(folder, max_num_batched_tokens=7)
    assert llm.llm_engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    assert tokens == [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS]


def test_bf16_runs_and_mostly_agrees(gemma_dirs, expected):
    # bf16 rounding may flip a near-tie late in a sequence; the first tokens must agree. The norms keep
    # 1 + weight in float32 whatever the dtype, as Transformers computes them.
    for name in ("gemma2", "gemma3"):
        llm = LLM(gemma_dirs[name], dtype="bfloat16", kv_cache_memory=1 << 22)
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids[:3] == expected[name][0][:3]
        model = llm.llm_engine.runner.model
        assert model.norm.weight.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.bfloat16


def test_other_gemma_generations_are_refused_by_name(gemma_dirs, tmp_path):
    for arch in ("Gemma3nForConditionalGeneration",):
        folder = tmp_path / arch
        shutil.copytree(gemma_dirs["gemma2"], folder)
        cfg = json.load(open(folder / "config.json"))
        cfg["architectures"] = [arch]
        json.dump(cfg, open(folder / "config.json", "w"))
        with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}'"):
            LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22)


def test_gemma1_activation_field(gemma_dirs, expected, tmp_path):
    # Gemma 1 reads hidden_act, whose legacy "gelu" (its first config.json files) means the tanh GELU in
    # Transformers' GemmaConfig; Gemma 2's hidden_activation field is not Gemma 1's
    for value, error in [("gelu", None), ("relu", "hidden_act 'relu'")]:
        folder = shutil.copytree(gemma_dirs["gemma"], tmp_path / value)
        cfg = json.load(open(folder / "config.json"))
        json.dump({**cfg, "hidden_act": value, "hidden_activation": "relu"}, open(folder / "config.json", "w"))
        if error:
            with pytest.raises(ValueError, match=error):
                LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22)
        else:
            assert _generate(str(folder))[0] == expected["gemma"]


def test_gemma1_two_ranks_give_one_ranks_greedy_tokens(gemma_dirs):
    from test_tensor_parallel import GREEDY as TP_GREEDY, _assert_same, _run  # it imports this module


    _assert_same(_run(gemma_dirs["gemma"], TP_GREEDY, 1), _run(gemma_dirs["gemma"], TP_GREEDY, 2))
