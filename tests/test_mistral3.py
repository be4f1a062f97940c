"""Mistral 3 (Mistral Small 3.1 / 3.2, Magistral Small, Devstral Small): folio serves the Mistral language model of a
Mistral3ForConditionalGeneration checkpoint, text in and text out. On tiny random checkpoints (a Pixtral vision tower,
a Mistral text model whose head_dim is not hidden_size / heads, as Mistral Small's), greedy outputs equal
Transformers' text-only generate token for token, with chunked prefill and preemption forced; the vision tower's and
projector's tensors are skipped, in the tensor names of the published checkpoints (which Transformers still saves) and
in those of Transformers 5's modules.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EOS_ID, VOCAB, hf_greedy, write_tokenizer
from folio import LLM, SamplingParams
from folio.models.model_config import ModelConfig
from greedy_match import PROMPTS, assert_greedy_matches

KV_BLOCK = 2 * 2 * 2 * 32 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
MAX_TOKENS = 24
WINDOW = 8
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              image_size=32, patch_size=8)
VARIANTS = {
    # as Mistral Small 3.1's config: no sliding window, an lm_head of its own
    "untied": dict(text=dict(sliding_window=None), tie_word_embeddings=False),
    # the text config's window on every layer, far shorter than the prompts; the lm_head tied by the outer config
    "window-tied": dict(text=dict(sliding_window=WINDOW), tie_word_embeddings=True),
}


def build_mistral3(folder: str, text: dict, tie_word_embeddings: bool, seed: int = 0) -> str:
    import transformers

    cfg = transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**{**TEXT, **text}), vision_config=transformers.PixtralVisionConfig(
            **VISION), image_token_index=VOCAB - 1, tie_word_embeddings=tie_word_embeddings, bos_token_id=1,
        eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(cfg).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "language_model" in name:  # initialised to ones: make a misplaced norm show
                param.normal_(1.0, 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def mistral3_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: build_mistral3(str(tmp_path_factory.mktemp(name)), **kw) for name, kw in VARIANTS.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(mistral3_dirs, name):
    tensors = load_file(os.path.join(mistral3_dirs[name], "model.safetensors"))
    # Transformers saves the names of the published checkpoints; the vision tensors are skipped, not refused
    assert {n.split(".")[0] for n in tensors} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert ("language_model.lm_head.weight" in tensors) == (name == "untied")
    assert_greedy_matches(mistral3_dirs[name], KV_BLOCK, max_tokens=MAX_TOKENS)


def test_sliding_window_of_the_text_config(mistral3_dirs):
    llm = LLM(mistral3_dirs["window-tied"], dtype="float32", kv_cache_memory=1 << 20)
    cfg = llm.llm_engine.model_config
    assert cfg.architecture == "Mistral3ForConditionalGeneration"
    assert cfg.sliding_windows == (WINDOW, WINDOW) and cfg.tie_word_embeddings
    assert llm.llm_engine.kv_cache_manager.windows == [WINDOW]
    assert max(map(len, PROMPTS)) > 2 * WINDOW  # the greedy match above crossed the window


def test_nested_tensor_names(mistral3_dirs, tmp_path):
    # the names of Transformers 5's modules (model.language_model.*, model.vision_tower.*, lm_head.weight), as a
    # checkpoint written from its state dict has them, load as the published ones do
    folder = str(tmp_path / "nested")
    shutil.copytree(mistral3_dirs["untied"], folder)
    path = os.path.join(folder, "model.safetensors")
    renamed = {}
    for name, tensor in load_file(path).items():
        name = name.replace("language_model.model.", "language_model.").replace("language_model.lm_head.", "lm_head.")
        renamed[name if name.startswith("lm_head.") else f"model.{name}"] = tensor
    assert {n.split(".")[1] for n in renamed if n.startswith("model.")} == {"language_model", "vision_tower",
                                                                            "multi_modal_projector"}
    save_file(renamed, path, metadata={"format": "pt"})
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(mistral3_dirs["untied"], p, MAX_TOKENS)
                                                        for p in PROMPTS]


# Mistral Small 3.1's config.json (sizes of the 24B model), written by Transformers 4: no tie_word_embeddings anywhere
MISTRAL_SMALL = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                 "image_token_index": 10, "vision_config": {"model_type": "pixtral", "hidden_size": 1024},
                 "text_config": {"model_type": "mistral", "head_dim": 128, "hidden_size": 5120,
                                 "intermediate_size": 32768, "max_position_embeddings": 131072,
                                 "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                                 "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
                                 "vocab_size": 131072}}


def test_config_parsing():
    cfg = ModelConfig.from_hf_dict(MISTRAL_SMALL)
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (
        "Mistral3ForConditionalGeneration", 5120, 128, 8)
    assert cfg.rope_theta == 1e9 and cfg.sliding_windows == () and not cfg.tie_word_embeddings
    # a text config that leaves sliding_window out has Mistral's default, on every layer
    text = {k: v for k, v in MISTRAL_SMALL["text_config"].items() if k != "sliding_window"}
    assert ModelConfig.from_hf_dict({**MISTRAL_SMALL, "text_config": text}).sliding_windows == (4096,) * 40


def test_other_language_models_are_refused(mistral3_dirs, tmp_path):
    # Ministral 3 nests a language model of its own (scaled attention) in the same architecture
    folder = tmp_path / "ministral3"
    shutil.copytree(mistral3_dirs["untied"], folder)
    cfg = json.load(open(folder / "config.json"))
    cfg["text_config"]["model_type"] = "ministral3"
    json.dump(cfg, open(folder / "config.json", "w"))
    with pytest.raises(ValueError, match="Mistral3ForConditionalGeneration with a 'ministral3' language model"):
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22)


def test_a_resaved_checkpoint_with_its_own_lm_head_stays_untied(mistral3_dirs, tmp_path):
    """Re-saved by Transformers 5, a published checkpoint gets the outer flag true beside the language model's
    false, and keeps its lm_head: the file decides, and the head is its own."""
    folder = str(tmp_path / "resaved")
    shutil.copytree(mistral3_dirs["untied"], folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["text_config"].get("tie_word_embeddings", False) is False
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "tie_word_embeddings": True}, f)
    params = SamplingParams(temperature=0, max_tokens=8)
    resaved, original = (LLM(d, dtype="float32", kv_cache_memory=1 << 20) for d in (folder, mistral3_dirs["untied"]))
    assert not resaved.llm_engine.model_config.tie_word_embeddings
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    assert [o.outputs[0].token_ids for o in resaved.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in original.generate(prompts, params, use_tqdm=False)]
