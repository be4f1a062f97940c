"""The int8 and int4 linear methods and the `quantization` engine option: shard-by-shard quantisation while
loading, the tied lm_head, which layers each scheme quantises, and whole models against float Transformers."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from folio import LLM, SamplingParams
from folio.config import EngineConfig
from folio.models import int4_blocks, int8_blocks, quant_kernels, rescored_head
from folio.models import quant_reference as ref
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int4_linear import Int4LinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear
from folio.models.quantization import quantization_chooser
from folio.models.quantized_linear import dequantize_min_rows
from tests.conftest import hf_logprobs
from int8_weights import int8_weight

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="needs the quantised linear kernel built")

PROMPT = [1] + list(range(5, 60))
# Mean |logprob - Transformers' float32 logprob| over the prompt's tokens (whose mean |logprob| is 7.4): measured
# 0.03-0.04 (w8a16), 0.06 (int8, W8A8) and 0.53 (int4, groups of 32) on these 2-layer random models of width 64, where
# rounding noise weighs far more than in real models (folio bench perplexity measures those); a wrong kernel
# is off by whole units.
MEAN_LOGPROB_ERROR = {"w8a16": 0.08, "int8": 0.12, "int4": 0.9, "w4a8": 0.9}


def _fused_layer(method, bias: bool = False) -> tuple[Linear, dict]:
    """A float32 layer of the method, its weight in the row-major format (int4 on AVX2 CPUs would keep only
    column blocks, which tests/test_int4_blocks.py covers)."""
    layer = Linear(64, {"q": 64, "k": 32, "v": 32}, bias=bias, params_dtype=torch.float32)
    layer.bind(method)
    shards = {s: torch.randn(rows, 64) for s, (_, rows) in layer.shards.items()}
    for shard_id, tensor in shards.items():
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
    if bias:
        for shard_id, (_, rows) in layer.shards.items():
            layer.bias.weight_loader(layer.bias, torch.randn(rows), shard_id)
    with mock.patch.object(int4_blocks, "available", lambda dtype=torch.bfloat16: False), \
            mock.patch.object(int8_blocks, "available", lambda dtype: False):
        method.process_weights_after_loading(layer)
    return layer, shards


@pytest.mark.parametrize("method", [Int8LinearMethod(), Int8LinearMethod(int8_activations=True, onednn=False),
                                    Int8LinearMethod(int8_activations=True, rotated=True, onednn=False),
                                    Int4LinearMethod()], ids=["w8a16", "w8a8", "w8a8-rotated", "int4"])
def test_shards_quantise_as_they_load_into_their_rows(method):
    layer, shards = _fused_layer(method, bias=True)
    whole = torch.cat(list(shards.values()))
    packed, scales, offsets = method.quantize(whole)  # scales are per row: shards quantise independently
    assert torch.equal(layer.weight, packed) and torch.equal(layer.weight_scale, scales)
    assert (layer.weight_offset is None) == (offsets is None)
    assert layer.bias.dtype == torch.float32
    x = torch.randn(3, 64)
    if getattr(method, "int8_activations", False):
        rotated = method.rotated
        assert torch.equal(layer(x), ref.w8a8_linear(x, packed, scales.view(-1), layer.bias, rotated))
    else:
        weight_only = ref.weight_only_linear(x, packed, scales, offsets, layer.bias, compute_dtype=torch.float64)
        assert torch.allclose(layer(x), weight_only.float(), rtol=1e-5, atol=1e-5)


def test_a_rotated_layer_computes_x_times_the_unrotated_weight():
    """rotate(x) times rotate(W) / B is x W^T: the rotation changes only what is rounded. B is the largest power
    of two dividing K, so 96 = 3 x 32 rotates in three blocks of 32 and 576 in nine of 64."""
    assert [ref.rotation_block(k) for k in (32, 96, 576, 896, 1536, 4096, 4864)] == [32, 32, 64, 128, 512, 4096, 256]
    for k in (96, 576):
        x, w = torch.randn(5, k, dtype=torch.float64), torch.randn(7, k, dtype=torch.float64)
        b = ref.rotation_block(k)
        assert torch.allclose(ref.rotate(x).double() @ (ref.rotate(w).double() / b).T, x @ w.T, atol=1e-4)
        hadamard = ref.rotate(torch.eye(k))[:b, :b]
        assert torch.equal(hadamard, hadamard.T) and torch.equal(hadamard.abs(), torch.ones(b, b))
        assert torch.equal(hadamard @ hadamard, b * torch.eye(b))
        assert torch.equal(ref.rotate(torch.eye(k)), torch.block_diag(*[hadamard] * (k // b)))
    # an outlier channel no longer sets its row's scale alone: the rounding error falls
    x = torch.randn(64, 896)
    x[:, 7] *= 100
    w = torch.randn(128, 896) * 0.05
    exact = x @ w.T
    plain, rotated = Int8LinearMethod(True, onednn=False), Int8LinearMethod(True, rotated=True, onednn=False)
    errors = []
    for method in (plain, rotated):
        layer = Linear(896, 128, params_dtype=torch.float32)
        layer.bind(method)
        layer.weight.weight_loader(layer.weight, w, None)
        method.process_weights_after_loading(layer)
        errors.append(float((layer(x) - exact).abs().mean()))
    assert errors[1] < errors[0] / 3, errors
    with pytest.raises(ValueError, match="rotated int8 layer quantises its activations"):
        Int8LinearMethod(int8_activations=False, rotated=True)


@pytest.mark.parametrize("method", [Int8LinearMethod(), Int4LinearMethod()], ids=["w8a16", "int4"])
def test_prefill_sized_batches_run_the_dense_gemm_on_the_dequantised_weight(method):
    layer, _ = _fused_layer(method, bias=True)
    weight = ref.dequantize(layer.weight, layer.weight_scale, layer.weight_offset)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(dequantize_min_rows(dtype), 64, dtype=dtype)
        want = torch.nn.functional.linear(x, weight.to(dtype), layer.bias.to(dtype))
        assert torch.equal(layer(x), want), dtype


def test_a_wrong_shard_or_shape_is_a_value_error():
    layer = Linear(64, {"q": 64, "k": 32}, params_dtype=torch.float32)
    layer.bind(Int8LinearMethod())
    with pytest.raises(ValueError, match=r"has shape \(32, 32\), expected \(32, 64\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 32), "k")
    with pytest.raises(ValueError, match="shard 'v'"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 64), "v")


@pytest.mark.parametrize("rotated", [False, True])
def test_a_tied_lm_head_gets_its_own_int8_copy_and_the_embedding_stays_float(rotated):
    embedding = torch.nn.Parameter(torch.randn(100, 64), requires_grad=False)
    head = Linear(64, 100, tied_to=embedding)
    method = Int8LinearMethod(int8_activations=rotated, rotated=rotated)
    head.bind(method)
    method.process_weights_after_loading(head)
    assert int8_weight(head).dtype == torch.int8 and embedding.dtype == torch.float32
    stored = ref.rotate(embedding) / 64 if rotated else embedding  # K = 64: one block of 64
    assert torch.equal(int8_weight(head), ref.quantize_int8(stored, 64)[0])


def test_schemes_quantise_every_layer_they_can():
    dense = DenseLinearMethod()
    layer, odd = Linear(896, 128), Linear(40, 8)
    int4 = quantization_chooser("int4", dense)
    assert isinstance(int4("layers.0.mlp.down_proj", layer), Int4LinearMethod)
    assert int4("layers.0.mlp.down_proj", layer).group_size(896) == 32
    assert quantization_chooser("int4-g128", dense)("layers.0.mlp.down_proj", layer).group_size(896) == 128
    assert quantization_chooser("int4-g128", dense)("layers.0.mlp.down_proj", layer).group_size(576) == 32
    assert isinstance(int4("lm_head", layer), Int8LinearMethod)  # logits keep 8 bits
    assert int4("layers.0.self_attn.o_proj", odd) is dense  # K not a multiple of 32
    w8a16, int8 = quantization_chooser("w8a16", dense)("lm_head", layer), quantization_chooser("int8", dense)("x", layer)
    assert not w8a16.int8_activations and not w8a16.rotated and int8.int8_activations and int8.rotated
    assert not int4("lm_head", layer).int8_activations
    # int16 activations (as accurate as float ones) for w8a16 and the heads of int4, not int8's nor w4a8's
    for scheme, name in (("int4", "lm_head"), ("int4-g128", "lm_head"), ("w8a16", "lm_head"), ("w8a16", "x")):
        chosen = quantization_chooser(scheme, dense)(name, layer)
        assert chosen.int16_activations and not chosen.int8_activations and not chosen.rotated
    int8_head = quantization_chooser("int8", dense)("lm_head", layer)
    assert int8_head.int8_activations and int8_head.rotated and not int8_head.int16_activations
    w4a8 = quantization_chooser("w4a8", dense)
    assert w4a8("x", layer).int8_activations and w4a8("lm_head", layer).int8_activations
    assert w4a8("lm_head", layer).rotated and not w4a8("lm_head", layer).int16_activations
    assert isinstance(w4a8("x", layer), Int4LinearMethod) and not int4("x", layer).int8_activations
    assert quantization_chooser("gguf", dense)("x", layer) is dense  # the GGUF loader binds its own layers
    with pytest.raises(ValueError, match="quantization must be one of int8, w8a16, int4, int4-g128, w4a8, gguf"):
        EngineConfig.from_kwargs(quantization="int3")


@pytest.mark.parametrize("scheme", ["int8", "w8a16", "int4", "w4a8"])
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False), ("phi3", False)])
def test_quantised_models_stay_close_to_float_transformers(tiny_model_factory, scheme, arch, tie):
    folder = tiny_model_factory(arch, tie)
    llm = LLM(folder, dtype="float32", quantization=scheme, kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    down = model.layers[0].mlp.down_proj
    blocks = getattr(down, "int4_blocks", None)  # weight-only int4 on AVX2: only the column blocks
    assert (blocks is not None) == (scheme == "int4" and int4_blocks.available(torch.float32))
    int8 = getattr(down, "int8_blocks", None)  # and weight-only int8
    assert (int8 is not None) == (scheme == "w8a16" and int8_blocks.available(torch.float32))
    scales = down.weight_scale if down.weight_scale is not None else (blocks or int8).scales
    assert scales.dtype == torch.float32
    weight = blocks.codes if blocks is not None else int8_weight(down)
    assert weight.dtype == (torch.uint8 if scheme in ("int4", "w4a8") else torch.int8)
    if scheme == "int4" and rescored_head.serves(model.lm_head):  # a tied head of block layers: rescored int4
        assert isinstance(model.lm_head.method, rescored_head.RescoredInt4Head)
    else:
        assert int8_weight(model.lm_head).dtype == torch.int8
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
    want = hf_logprobs(folder, PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert float((got - want).abs().mean()) < MEAN_LOGPROB_ERROR[scheme]


@pytest.mark.parametrize("scheme", ["int8", "w8a16", "int4", "w4a8"])
def test_a_bf16_model_keeps_float32_biases_and_exact_scales(tiny_model_factory, scheme):
    folder = tiny_model_factory("qwen2", False)
    llm = LLM(folder, dtype="bfloat16", quantization=scheme, kv_cache_memory=1 << 22)
    qkv = llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.bias.dtype == torch.float32
    if getattr(qkv, "int4_blocks", None) is not None:  # weight-only int4 on AVX512-BF16: float16 in the blocks
        assert qkv.weight_scale is None and qkv.int4_blocks.scales.dtype == torch.float16
    else:
        assert qkv.weight_scale.dtype == torch.float32
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("method", [Int8LinearMethod(int8_activations=True, rotated=True), Int8LinearMethod(),
                                    Int8LinearMethod(int16_activations=True), Int4LinearMethod()],
                         ids=["int8", "w8a16", "int16-activations", "int4"])
def test_float16_activations_take_every_path(method):
    """The kernels and the epilogue compute in float32 or bf16; float16 comes back as float16, as float32 rounded."""
    layer = Linear(64, 48, params_dtype=torch.float16)
    layer.bind(method)
    weight = torch.randn(48, 64)
    layer.weight.weight_loader(layer.weight, weight, None)
    method.process_weights_after_loading(layer)
    for rows in (1, 8, 200):  # the kernel, oneDNN or the bf16 threshold, the dense GEMM
        x = torch.randn(rows, 64, dtype=torch.float16)
        y = layer(x)
        assert y.dtype == torch.float16 and y.shape == (rows, 48)
        assert torch.allclose(y.float(), layer(x.float()), rtol=1e-2, atol=1e-2)  # float16 GEMMs, 11 bits
