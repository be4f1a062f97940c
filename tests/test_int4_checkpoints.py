"""Pre-quantised GPTQ and AWQ int4 checkpoints load, repacked exactly into folio's int4 format, and compute what
the float model of their dequantised weights computes.

The checkpoints are written here by packers that follow AutoGPTQ's and AutoAWQ's layouts (independently of
folio.models.int4_checkpoints): GPTQ qweight [K / 8, N] packed along K, AWQ qweight [K, N / 8] packed along N
in the order 0, 2, 4, 6, 1, 3, 5, 7, zeros packed along N, GPTQ v1's stored zero = zero - 1."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model, runs_float32_int16_codes
from folio import LLM, SamplingParams
from folio.models import quant_kernels
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int4_checkpoints import Int4CheckpointConfig, Int4CheckpointMethod
from folio.models.quant_reference import dequantize
from int4_weights import int4_rows

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="needs the quantised linear kernel built")

PROMPT = [1] + list(range(5, 50))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in 0..15, zeros [N, groups] in 1..15, float16 scales [N, groups]), asymmetric."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-low / scales.float()).clamp(1, 15).long()  # never 0: GPTQ v1 stores zero - 1
    q = (torch.round(groups / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15).long()
    return q.reshape(n, k), zeros, scales


def _dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group_size = q.shape[1] // zeros.shape[1]
    return ((q - zeros.repeat_interleave(group_size, dim=1)).float()
            * scales.float().repeat_interleave(group_size, dim=1))


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 of the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_rows(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] -> [R / 8, C]: word r holds values[8r + order[i]] in bits 4i..4i+3."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for i, v in enumerate(order):
        words |= values[v::8] << (4 * i)
    return _int32(words)


def _pack_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    return _pack_rows(values.T, order).T.contiguous()


def _checkpoint_tensors(fmt: str, name: str, w: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    """The tensors that replace `name` (a ...proj.weight [N, K]) in the checkpoint, and the dequantised weight."""
    q, zeros, scales = _quantize(w, w.shape[1] if group_size == -1 else group_size)
    prefix = name.removesuffix("weight")
    if fmt == "awq":
        out = {"qweight": _pack_columns(q.T, AWQ_ORDER), "qzeros": _pack_columns(zeros.T, AWQ_ORDER)}
    else:
        stored = zeros - 1 if fmt == "gptq" else zeros
        out = {"qweight": _pack_rows(q.T, list(range(8))), "qzeros": _pack_columns(stored.T, list(range(8))),
               "g_idx": (torch.arange(w.shape[1]) // (w.shape[1] if group_size == -1 else group_size)).int()}
    out["scales"] = scales.T.contiguous()
    return {prefix + key: value for key, value in out.items()}, _dequantize(q, zeros, scales)


def _config(fmt: str, group_size: int) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
            "checkpoint_format": fmt, "true_sequential": True}


def _write(src: str, dest: str, tensors: dict, quantization_config: dict | None) -> str:
    shutil.copytree(src, dest)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    return dest


def _prequantize(src: str, dest: str, fmt: str, group_size: int, linears: tuple[str, ...] = LINEARS,
                 keep_float: tuple[str, ...] = ()) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(the quantised folder, a float folder of its dequantised weights, {checkpoint name: dequantised});
    keep_float: checkpoint names of weights left in float."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantised, dequantised, deq = {}, {}, {}
    for name, tensor in tensors.items():
        if any(f".{p}.weight" in name for p in linears) and name not in keep_float:
            packed, deq[name] = _checkpoint_tensors(fmt, name, tensor, group_size)
            quantised.update(packed)
            dequantised[name] = deq[name]
        else:
            quantised[name] = dequantised[name] = tensor
    return (_write(src, dest, quantised, _config(fmt, group_size)),
            _write(src, dest + "-float", dequantised, None), deq)


def _logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """K of 128 and 256, where GPTQ's usual group size of 128 applies."""
    return build_tiny_model(str(tmp_path_factory.mktemp("wide-llama")), "llama", hidden_size=128,
                            intermediate_size=256)


def _tolerance(llm: LLM) -> dict:
    """The logprobs' tolerance against the float model's: float32 summation order, and the float32 block
    kernels' 16-bit codes of x where they run (measured within 5e-4 relative; a wrong repacking is off by whole
    units)."""
    return {"atol": 1e-4, "rtol": 2e-3 if runs_float32_int16_codes(llm) else 0}


@pytest.mark.parametrize("fmt,group_size,model", [
    ("gptq", 32, "qwen2"),      # v1 zeros; q (64 rows) and k/v (32) of different widths, biases
    ("gptq_v2", -1, "qwen2"),   # one group per row: K = 64 and 128
    ("gptq", 128, "wide"),
    ("awq", 64, "qwen2"),
    ("gptq_v2", 64, "llama-tied"),  # the lm_head is the embedding's: dense
])
def test_checkpoint_loads_exactly(tiny_model_factory, wide_llama, tmp_path, fmt, group_size, model):
    src = wide_llama if model == "wide" else tiny_model_factory(model.removesuffix("-tied"), model.endswith("-tied"))
    folder, float_folder, deq = _prequantize(src, str(tmp_path / fmt), fmt, group_size)
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
    net = llm.llm_engine.runner.model
    for i, layer in enumerate(net.layers):
        for block, fused, parts in (("self_attn", layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                                    ("self_attn", layer.self_attn.o_proj, ("o_proj",)),
                                    ("mlp", layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
                                    ("mlp", layer.mlp.down_proj, ("down_proj",))):
            assert isinstance(fused.method, Int4CheckpointMethod)
            assert not hasattr(fused, "qweight")  # the checkpoint's tensors are freed once repacked
            expected = torch.cat([deq[f"model.layers.{i}.{block}.{p}.weight"] for p in parts])
            blocks = getattr(fused, "int4_blocks", None)  # float32 on AVX2 without AVX-512: only the blocks
            if blocks is None:
                assert fused.weight.dtype == torch.uint8
                assert torch.equal(dequantize(fused.weight, fused.weight_scale, fused.weight_offset), expected)
            else:
                assert fused.weight is None and torch.equal(dequantize(*int4_rows(blocks)), expected)
    assert isinstance(net.lm_head.method, DenseLinearMethod)  # kept as a plain weight by the checkpoint: dense
    reference = LLM(float_folder, dtype="float32", kv_cache_memory=1 << 22)
    torch.testing.assert_close(_logprobs(llm), _logprobs(reference), **_tolerance(llm))


def test_layers_the_checkpoint_keeps_in_float_run_dense(tiny_model_factory, tmp_path):
    """A layer the checkpoint stores as a plain weight (AWQ's modules_to_not_convert) runs as any float layer."""
    kept = "model.layers.1.mlp.down_proj.weight"
    folder, float_folder, _ = _prequantize(tiny_model_factory("llama", False), str(tmp_path / "awq"), "awq", 32,
                                           keep_float=(kept,))
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
    net = llm.llm_engine.runner.model
    assert not isinstance(net.layers[1].mlp.down_proj.method, Int4CheckpointMethod)
    assert isinstance(net.layers[1].mlp.down_proj.method, DenseLinearMethod)  # kept float by the checkpoint: dense
    assert isinstance(net.layers[0].mlp.down_proj.method, Int4CheckpointMethod)
    reference = LLM(float_folder, dtype="float32", kv_cache_memory=1 << 22)
    torch.testing.assert_close(_logprobs(llm), _logprobs(reference), **_tolerance(llm))


@pytest.mark.parametrize("change,match", [
    ({"bits": 8}, "bits 8"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"group_size": 100}, "group_size 100"),
    ({"quant_method": "gptq", "dynamic": {"-:.*lm_head": {}}}, "dynamic"),
    ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point False"),
])
def test_unsupported_configs_are_named(change, match):
    base = _config("awq" if change.get("quant_method") == "awq" else "gptq", 128)
    with pytest.raises(ValueError, match=match):
        Int4CheckpointConfig.parse({**base, **change})


def test_unsupported_checkpoints_are_refused(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2", False)
    folder, _, _ = _prequantize(src, str(tmp_path / "ok"), "gptq", 32)
    tensors = load_file(os.path.join(folder, "model.safetensors"))

    def variant(name: str, config_change: dict, tensor_change: dict) -> str:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        return _write(src, str(tmp_path / name), {**tensors, **tensor_change},
                      {**config["quantization_config"], **config_change})

    g_idx = "model.layers.0.mlp.up_proj.g_idx"
    act_order = variant("desc-act", {"desc_act": True}, {g_idx: tensors[g_idx][torch.randperm(64)].contiguous()})
    with pytest.raises(ValueError, match=f"'{g_idx}' is not k // group_size: act-order"):
        LLM(act_order, dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="group_size 128 does not fit a layer of 64 inputs"):
        LLM(variant("g128", {"group_size": 128}, {}), dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        LLM(variant("bnb", {"quant_method": "bitsandbytes"}, {}), dtype="float32", kv_cache_memory=1 << 22)


def test_fused_checkpoint_tensors_are_refused(tiny_model_factory, tmp_path):
    """Phi-3 stores q/k/v (and gate/up) as one tensor: refused by name rather than split wrongly."""
    folder, _, _ = _prequantize(tiny_model_factory("phi3", False), str(tmp_path / "phi3"), "gptq", 32,
                                ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    with pytest.raises(ValueError, match=r"_proj.qweight' holds all the shards of a fused layer"):
        LLM(folder, dtype="float32", kv_cache_memory=1 << 22)
