"""MXFP4 linear layers (folio.models.mxfp4_linear): the kernel against F.linear on the dequantised weight for every
compiled instruction set, batch size and dtype; the weight loaders' checks; ggml's MXFP4 blocks repacked into the
layers' format; GPT-OSS's MXFP4 checkpoint with its experts kept as MXFP4 giving the dequantised load's and
Transformers' greedy tokens and logprobs, in 17/64 of bf16's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch.nn import functional as F

from conftest import hf_greedy_logprobs
from folio.loader.gguf_native import mxfp4_from_ggml
from folio.loader.model_loader import load_model
from folio.models import fused_moe, mxfp4, mxfp4_linear
from folio.models.experts_method import PerExpertMethod
from folio.models.linear import Linear, linear_layers
from folio.models.moe import Experts
from greedy_match import greedy_logprobs
import test_gpt_oss

gpt_oss_dir, mxfp4_dir = test_gpt_oss.gpt_oss_dir, test_gpt_oss.mxfp4_dir  # its fixtures: the tiny MXFP4 GPT-OSS
PROMPTS = test_gpt_oss.PROMPTS
needs_kernel = pytest.mark.skipif(not mxfp4_linear.available(), reason="the MXFP4 kernel does not build here")
ROWS = (1, 3, 17, 64, 130)  # 17: chunks of 8 rows and a rest; 130: past the method's GEMM_MIN_ROWS


def random_mxfp4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of every code, scales from 2^-4 to 2^2."""
    blocks = torch.randint(0, 256, (rows, cols // mxfp4.BLOCK, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(123, 130, (rows, cols // mxfp4.BLOCK), dtype=torch.uint8, generator=g)


def assert_matches_dequantised(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None) -> None:
    """y is F.linear on the dequantised weight in float32, up to the order of the sums (and bf16's one rounding)."""
    want = F.linear(x.float(), weight, bias)
    assert y.dtype == x.dtype and y.shape == want.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y, want.to(torch.bfloat16), rtol=8e-3, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_f_linear_on_the_dequantised_weight(dtype, with_bias):
    g = torch.Generator().manual_seed(0)
    n, k = 37, 96  # neither a multiple of a vector's lanes nor of the kernel's task rows
    blocks, scales = random_mxfp4(n, k, g)
    weight = mxfp4.dequantize(blocks, scales).float()
    assert torch.equal(mxfp4_linear.dequantize(blocks, scales), weight)
    bias = torch.randn(n, generator=g) if with_bias else None
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).to(dtype)
        for isa in mxfp4_linear.isas():
            assert_matches_dequantised(mxfp4_linear.linear(x, blocks, scales, bias, isa), x, weight, bias)


@needs_kernel
def test_scale_extremes_equal_the_dequantised_weight():
    """E8M0's low end, 2^-127 (a subnormal float32, times 0.5 still exact), and the largest scale whose values stay
    finite, 2^125; every code under each."""
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2).view(1, 1, 16).repeat(4, 1, 1)
    scales = torch.tensor([[0], [1], [127], [252]], dtype=torch.uint8)
    weight = mxfp4.dequantize(blocks, scales).float()
    assert weight[0, 1] == 2.0 ** -128 and weight[3, 15] == -6 * 2.0 ** 125
    for isa in mxfp4_linear.isas():
        eye = torch.eye(32)
        assert torch.equal(mxfp4_linear.linear(eye, blocks, scales, None, isa), weight.t())


def fused_layer(k: int, n: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A gate/up Linear with a bias on the MXFP4 method, its shards loaded through the weight loaders, and its whole
    dequantised weight and bias."""
    g = torch.Generator().manual_seed(1)
    layer = Linear(k, {0: n, 1: n}, bias=True)
    layer.bind(mxfp4_linear.Mxfp4LinearMethod())
    weights, biases = [], []
    for shard in (0, 1):
        blocks, scales = random_mxfp4(n, k, g)
        bias = torch.randn(n, generator=g)
        layer.weight.weight_loader(layer.weight, blocks, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, scales, shard)
        layer.bias.weight_loader(layer.bias, bias, shard)
        weights.append(mxfp4.dequantize(blocks, scales).float())
        biases.append(bias)
    layer.method.process_weights_after_loading(layer)
    return layer, torch.cat(weights), torch.cat(biases)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False])
def test_method_loads_shards_and_equals_f_linear(kernel, monkeypatch):
    """Through the layer: the kernel below GEMM_MIN_ROWS, the GEMM from it; the torch reference without the kernel."""
    layer, weight, bias = fused_layer(64, 20)
    if not kernel:
        monkeypatch.setattr(mxfp4_linear.KERNEL, "load", lambda: None)
    g = torch.Generator().manual_seed(2)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 64, generator=g).to(dtype)
            assert_matches_dequantised(layer(x), x, weight, bias)
    x = torch.randn(2, 3, 64, generator=g)
    assert layer(x).shape == (2, 3, 40)


def test_weight_loader_checks_dtype_and_shape():
    layer = Linear(64, {0: 8, 1: 8})
    layer.bind(mxfp4_linear.Mxfp4LinearMethod())
    blocks = torch.zeros(8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"has dtype torch.float32, expected torch.uint8 \(MXFP4 blocks or scales\)"):
        layer.weight.weight_loader(layer.weight, blocks.float(), 0)
    with pytest.raises(ValueError, match=r"has shape \(8, 2, 8\), expected \(8, 2, 16\)"):
        layer.weight.weight_loader(layer.weight, blocks[..., :8], 0)
    with pytest.raises(ValueError, match=r"has shape \(8, 3\), expected \(8, 2\)"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.zeros(8, 3, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match=r"input size divisible by 32, got Linear\(48, 8\)"):
        Linear(48, 8).bind(mxfp4_linear.Mxfp4LinearMethod())


def test_ggml_blocks_repack_to_gguf_s_own_values():
    """ggml's MXFP4 rows (each block its scale byte, then value i in byte i's low nibble and i + 16 in its high one),
    repacked, dequantise to what gguf's own dequantize makes of them: random codes under every scale byte."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (8, 32, 17), dtype=np.uint8)
    rows[..., 0] = rng.permutation(256).reshape(8, 32)
    blocks, scales = mxfp4_from_ggml(rows.reshape(8, -1))
    assert blocks.shape == (8, 32, 16) and scales.shape == (8, 32)
    with np.errstate(over="ignore"):  # from scale byte 253 the largest codes overflow float32: inf in both
        want = gguf_dequantize(rows.reshape(8, -1), GGMLQuantizationType.MXFP4)
    assert torch.equal(mxfp4.dequantize(blocks, scales).float(), torch.from_numpy(want))


def experts_methods(model: torch.nn.Module) -> set[type]:
    return {type(m.method) for m in model.modules() if isinstance(m, Experts)}


@needs_kernel
def test_experts_keep_mxfp4_in_17_64ths_of_bf16s_bytes(mxfp4_dir):
    model = load_model(mxfp4_dir, torch.float32, 64).model
    assert experts_methods(model) == {PerExpertMethod}
    layers = [layer for name, layer in linear_layers(model) if ".experts." in name]
    assert layers and all(isinstance(layer.method, mxfp4_linear.Mxfp4LinearMethod) for layer in layers)
    kept = sum(layer.weight.nbytes + layer.weight_scale.nbytes for layer in layers)
    assert kept / sum(2 * layer.output_size * layer.input_size for layer in layers) == 17 / 64


@needs_kernel
def test_kept_mxfp4_equals_the_dequantised_load_and_transformers(mxfp4_dir, monkeypatch):
    kept = greedy_logprobs(mxfp4_dir, PROMPTS, 12)
    hf = hf_greedy_logprobs(mxfp4_dir, PROMPTS[0], 12)  # Transformers dequantises (Mxfp4Config(dequantize=True))
    assert kept[0][0] == hf[0] and kept[0][1] == pytest.approx(hf[1], abs=1e-4)
    monkeypatch.setattr(mxfp4_linear, "available", lambda: False)  # as where the kernel does not build
    assert experts_methods(load_model(mxfp4_dir, torch.float32, 64).model) == {fused_moe.FusedExpertsMethod}
    for (tokens, logprobs), (want_tokens, want) in zip(kept, greedy_logprobs(mxfp4_dir, PROMPTS, 12)):
        assert tokens == want_tokens and logprobs == pytest.approx(want, abs=1e-4)
