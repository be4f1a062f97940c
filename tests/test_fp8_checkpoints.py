"""FP8 checkpoints (quant_method "fp8"), dequantised as they load: greedy tokens and logprobs equal Transformers' on
tiny random models whose linear weights this file quantises to float8_e4m3fn, with a scale per block (blocks of 32
or fewer, so tiny layers have several, partial ones among them), per tensor or per output row.

Transformers 5 dequantises FP8 checkpoints on CPUs, but infers the block from the scale grid's shape (rows // scale
rows), which is wrong for partial blocks: there it is compared on a folder of the weights dequantised here, in
float32, by a loop over blocks independent of folio's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import _hf_model, build_tiny_model, hf_greedy_logprobs
from folio import LLM, SamplingParams
from folio.models import fp8_checkpoints
from folio.models.dense_linear import DenseLinearMethod
from folio.models.fp8_checkpoints import Fp8CheckpointConfig, dequantize, dequantized
from greedy_match import greedy_logprobs
from test_deepseek import build_deepseek
from test_tensor_parallel import GREEDY, _assert_same, _run

PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
MAX_TOKENS = 16
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# every projection, experts' and DeepSeek's kv_b_proj too; not the router, the norms, the embedding or the lm_head, as
# the released checkpoints keep them
QUANTISED = re.compile(r"_proj(_with_mqa)?\.weight$")
BLOCK = (32, 32)  # whole blocks of the tiny llama (Transformers reads its FP8 folder right), partial in DeepSeek's
PARTIAL = (24, 40)  # 64 rows: 24 + 24 + 16; 32 columns: one of 32


def _quantise(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes of w and a float32 scale per block of rows x cols (its absmax to FP8's largest)."""
    grid = (-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    q, scales = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scales[i, j] = block.abs().max() / FP8_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def _reference(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """float32(q) * its block's scale, block by block."""
    w = q.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] *= scales[i, j]
    return w


def _write(src: str, dest: str, tensors: dict[str, torch.Tensor], quantization_config: Optional[dict]) -> str:
    shutil.copytree(src, dest)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    config = json.load(open(os.path.join(dest, "config.json")))
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    json.dump(config, open(os.path.join(dest, "config.json"), "w"))
    return dest


def fp8_folders(src: str, dest: str, block: Optional[tuple[int, int]], **config) -> tuple[str, str]:
    """(the FP8 folder, the folder of its weights dequantised in float32). block None: attention scaled per tensor,
    the MLPs per output row, as `weight_scale` (vLLM's name)."""
    fp8, dequantised = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not QUANTISED.search(name):
            fp8[name] = dequantised[name] = w
            continue
        rows, cols = block or (w.shape[0] if "self_attn" in name else 1, w.shape[1])
        q, scales = _quantise(w, rows, cols)
        scale_name = name + ("_scale_inv" if block else "_scale")
        fp8[name], fp8[scale_name] = q, scales if block or "self_attn" not in name else scales.reshape(())
        dequantised[name] = _reference(q, scales, rows, cols)
    quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": list(block) if block else None, "modules_to_not_convert": ["lm_head"],
                           **config}
    return (_write(src, f"{dest}-fp8", fp8, quantization_config),
            _write(src, f"{dest}-float32", dequantised, None))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(FP8 folder, dequantised folder) by name, built once."""
    built: dict[str, tuple[str, str]] = {}

    def build(name: str) -> tuple[str, str]:
        if name not in built:
            root = str(tmp_path_factory.mktemp(name))
            arch, block = {"llama": ("llama", BLOCK), "llama-per-tensor-and-row": ("llama", None),
                           "qwen3_moe": ("qwen3_moe", PARTIAL), "deepseek-v3": ("v3", BLOCK)}[name]
            src = build_deepseek(f"{root}/src", arch) if arch == "v3" else build_tiny_model(f"{root}/src", arch)
            built[name] = fp8_folders(src, f"{root}/{name}", block)
        return built[name]

    return build


def _assert_matches(folio_folder: str, hf_folder: str) -> None:
    for (tokens, logprobs), prompt in zip(greedy_logprobs(folio_folder, PROMPTS, MAX_TOKENS), PROMPTS):
        hf_tokens, hf_logprobs = hf_greedy_logprobs(hf_folder, prompt, MAX_TOKENS)
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_block_scales_match_transformers_on_the_fp8_folder(folders):
    fp8, dequantised = folders("llama")
    weights = _hf_model(fp8).state_dict()  # dequantised by Transformers as by the reference here
    assert all(torch.equal(weights[name], w) for name, w in load_file(f"{dequantised}/model.safetensors").items())
    _assert_matches(fp8, fp8)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek-v3", "llama-per-tensor-and-row"])
def test_partial_blocks_experts_and_per_row_scales_match_transformers(folders, name):
    """Qwen3-MoE's experts and DeepSeek V3's (kv_a_proj's 40 rows, q_b_proj's 24 columns, kv_b_proj outside the
    linear methods) in partial blocks; per-tensor and per-row scales."""
    _assert_matches(*folders(name))


def test_the_linear_layers_load_float_weights(folders):
    llm = LLM(folders("qwen3_moe")[0], dtype="bfloat16", kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj.method, DenseLinearMethod)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.is_floating_point() and p.dim() > 1)


def test_two_ranks_give_one_ranks_greedy_tokens(folders):
    """Ranks' slices cut through blocks (16 rows of an expert's 32 against blocks of 24): each keeps its rows'
    scales."""
    folder = folders("qwen3_moe")[0]
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantization_requantises_the_dequantised_weights(folders, scheme):
    """quantization="int8" / "int4" quantises the dequantised weights as they load, as for a float folder: the first
    token's logprob near the dequantised model's, and not its own."""
    fp8, dequantised = folders("llama")
    llm = LLM(fp8, dtype="float32", quantization=scheme, kv_cache_memory=1 << 22)
    layer = llm.llm_engine.runner.model.layers[0].mlp.down_proj
    assert type(layer.method).__name__ == {"int8": "Int8LinearMethod", "int4": "Int4LinearMethod"}[scheme]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    float_logprob = hf_greedy_logprobs(dequantised, PROMPTS[0], 1)[1][0]
    assert 1e-5 < abs(out.logprobs[0][out.token_ids[0]].logprob - float_logprob) < 0.5


@pytest.mark.parametrize("field,value", [("activation_scheme", "static"), ("fmt", "e5m2"), ("weight_block_size", [128]),
                                         ("scale_fmt", "ue8m0"), ("expert_dtype", "fp4")])
def test_unsupported_configs_are_named(folders, tmp_path, field, value):
    src = folders("llama")[0]
    folder = _write(src, str(tmp_path / "bad"), load_file(os.path.join(src, "model.safetensors")),
                    {**json.load(open(os.path.join(src, "config.json")))["quantization_config"], field: value})
    with pytest.raises(ValueError, match=f"quantization_config: {field} "):
        LLM(folder, dtype="float32", kv_cache_memory=1 << 22)


def test_unpaired_or_misshapen_tensors_are_named():
    config = Fp8CheckpointConfig((32, 32))
    q, scales = _quantise(torch.randn(40, 64), 32, 32)
    cases = [([("a.weight", q)], "'a.weight' is 8-bit but has no weight_scale_inv"),
             ([("a.weight", q.float()), ("a.weight_scale_inv", scales)], "scales for 'a.weight' but no 8-bit weight"),
             ([("a.weight", q), ("a.weight_scale_inv", scales[:1])], r"'a.weight' has scales of shape \(1, 2\)"),
             ([("a.weight_scale_inv", scales), ("a.weight", q.to(torch.float8_e5m2))],
              "'a.weight' has a scale but is torch.float8_e5m2"),
             ([("a.input_scale", torch.ones(()))], "'a.input_scale' is a static activation scale")]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            list(dequantized(tensors, config, torch.float32))


@pytest.mark.parametrize("block", [(24, 40), (1, 64), None])
def test_dequantising_in_bands_equals_the_whole(monkeypatch, block):
    """Bands of whole rows of blocks (here one row of blocks of 24 a band, the last partial; 16 rows of per-row scales)
    give the block-by-block loop's weight; block None: one scale for the tensor."""
    monkeypatch.setattr(fp8_checkpoints, "_BAND_ELEMENTS", 64 * 16)
    w = torch.randn(70, 64)
    rows, cols = block or w.shape
    q, scales = _quantise(w, rows, cols)
    config = Fp8CheckpointConfig(block if block != (1, 64) else None)
    expected = _reference(q, scales, rows, cols)
    assert torch.equal(dequantize(q, scales, config, torch.float32), expected)
    assert torch.equal(dequantize(q, scales, config, torch.bfloat16), expected.bfloat16())
