"""Pre-quantised compressed-tensors checkpoints (int8 per channel, dynamic per-token activations) load as stored
and compute what quantising the float checkpoint on the fly computes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM, SamplingParams
from folio.models import quant_kernels, quantization
from folio.models.compressed_tensors import CompressedTensorsW8A8Method, int8_activations
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.quant_reference import quantize_int8
from int8_weights import int8_weight

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="needs the quantised linear kernel built")

PROMPT = [1] + list(range(5, 50))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(activations: bool) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                "strategy": "channel", "dynamic": False, "group_size": None}}
    group["input_activations"] = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                   "dynamic": True} if activations else None)
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def _prequantize(src: str, dest: str, activations: bool) -> str:
    """The float folder as llm-compressor saves it: int8 weights, float32 scales [N, 1], zero points on some."""
    shutil.copytree(src, dest)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if any(f".{p}.weight" in name for p in LINEARS):
            q, scale = quantize_int8(tensor, tensor.shape[1])
            out[name], out[name + "_scale"] = q, scale
            if "k_proj" in name:
                out[name + "_zero_point"] = torch.zeros(tensor.shape[0], 1, dtype=torch.int8)
        else:
            out[name] = tensor
    save_file(out, os.path.join(dest, "model.safetensors"))
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _config(activations)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    return dest


def _logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])


@pytest.mark.parametrize("activations,scheme", [(True, "int8"), (False, "w8a16")])
def test_prequantised_checkpoint_equals_on_the_fly_quantisation(tiny_model_factory, tmp_path, monkeypatch,
                                                                 activations, scheme):
    # on the fly, int8 rotates its layers; a checkpoint runs as stored, so it is compared with int8 unrotated
    monkeypatch.setattr(quantization, "Int8LinearMethod",
                        lambda int8_activations=False, rotated=False, **_: Int8LinearMethod(
                            int8_activations=int8_activations))
    src = tiny_model_factory("qwen2", False)
    folder = _prequantize(src, str(tmp_path / "w8a8"), activations)
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj.method, CompressedTensorsW8A8Method)
    assert int8_weight(model.layers[0].self_attn.qkv_proj).dtype == torch.int8
    assert isinstance(model.lm_head.method, DenseLinearMethod)  # ignored: dense
    on_the_fly = LLM(src, dtype="float32", quantization=scheme, kv_cache_memory=1 << 22)
    on_the_fly.llm_engine.runner.model.lm_head = model.lm_head  # the scheme would quantise it too
    assert torch.equal(_logprobs(llm), _logprobs(on_the_fly))


def test_unsupported_configs_are_named():
    assert int8_activations(_config(True)) and not int8_activations(_config(False))
    for change, match in ((("quant_method", "gptq"), "quant_method 'gptq'"), (("format", "pack-quantized"), "format")):
        bad = {**_config(True), change[0]: change[1]}
        with pytest.raises(ValueError, match=match):
            int8_activations(bad)
    bad = _config(True)
    bad["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match="weights .* are not supported"):
        int8_activations(bad)


def test_non_zero_zero_points_are_refused(tiny_model_factory, tmp_path):
    folder = _prequantize(tiny_model_factory("qwen2", False), str(tmp_path / "asym"), True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight_zero_point"][0] = 3
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.weight_zero_point' has non-zero zero points"):
        LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
