"""GGUF files generate exactly what Transformers generates from the same file."""

from __future__ import annotations

import os

import pytest
import torch

from folio import LLM, SamplingParams
from test_gguf_loader import ARCHS, write_tiny_gguf


pytestmark = pytest.mark.usefixtures("isolated_gguf_cache")


def _hf_from_gguf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_quantized_gguf_generates_like_transformers(tmp_path, arch):
    path = write_tiny_gguf(str(tmp_path / f"tiny-{arch}.gguf"), arch)  # matrices cycle through all quant types
    # dequantised, as Transformers loads a GGUF: run as stored (the default), a tied lm_head of a quantised
    # embedding is requantised to int8, which this random model's near-tied logits do not survive
    # (test_gguf_native compares the two forms)
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory=1 << 22)
    eos = llm.get_tokenizer().eos_token_id
    prompts = [[5, 6, 7, 8], [40, 41], list(range(60, 90))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
    hf = _hf_from_gguf(path)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos) for p in prompts]


def test_default_model_matches_transformers_own_gguf_load():
    from folio.loader.default_model import default_model_path

    path = default_model_path()
    llm = LLM(None, dtype="float32", kv_cache_memory=1 << 26)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    expected = _hf_greedy(_hf_from_gguf(path), prompt, 24, eos=2)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text.startswith(" Paris")
