"""The small-batch linear kernel (bf16 and float32): its results, and when the dense linear method and the models
use it."""

from __future__ import annotations

import pytest
import torch

from folio.models import small_batch_gemm
from folio.models.dense_linear import DenseLinearMethod
from folio.models.linear import Linear

bf16_kernel = pytest.mark.skipif(not small_batch_gemm.available(torch.bfloat16),
                                 reason="the bf16 small-batch kernel needs AVX512-BF16 and a working compiler")
f32_kernel = pytest.mark.skipif(not small_batch_gemm.available(torch.float32),
                                reason="the float32 small-batch kernel needs AVX2+FMA and a working compiler")


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps separate a and b (same-sign values; bf16 bit patterns are ordered like ints)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@bf16_kernel
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (1000, 576), (37, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_product_to_one_bf16_step(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = small_batch_gemm.linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # float32 sums, one rounding to bf16: the correctly rounded result or its neighbour
    want = exact.to(torch.bfloat16)
    same_sign = (got.float() * want.float() >= 0)
    assert bool((bf16_ulps_apart(got, want)[same_sign] <= 1).all())
    assert bool(((got.float() - exact.float()).abs()[~same_sign] < 1e-2).all())  # near zero


@bf16_kernel
def test_strided_rows_and_errors():
    x = torch.randn(2, 128).to(torch.bfloat16)[:, :64]  # row stride 128
    w = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(small_batch_gemm.linear(x, w, None), small_batch_gemm.linear(x.contiguous(), w, None))
    with pytest.raises(RuntimeError, match="K % 32"):
        small_batch_gemm.linear(torch.randn(1, 40).to(torch.bfloat16), torch.randn(3, 40).to(torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="M <= 3"):
        small_batch_gemm.linear(torch.randn(4, 64).to(torch.bfloat16), w, None)


def packed_linear(small_batches: bool, k: int = 64) -> Linear:
    """A bf16 layer on the dense method, which keeps plain weights for the kernel when small_batches."""
    layer = Linear(k, 48, bias=True, params_dtype=torch.bfloat16)
    method = DenseLinearMethod(keep_copies=small_batches)
    layer.bind(method)
    layer.weight.data.copy_(torch.randn(48, k))
    layer.bias.data.copy_(torch.randn(48))
    method.process_weights_after_loading(layer)
    return layer


@bf16_kernel
def test_linear_sends_small_batches_to_the_kernel(monkeypatch):
    layer = packed_linear(small_batches=True)
    reference = layer.weight.float()
    calls = []
    real = small_batch_gemm.linear
    monkeypatch.setattr(small_batch_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 3, 4, 16):
        x = torch.randn(m, 64).to(torch.bfloat16)
        y = layer(x)
        assert torch.allclose(y.float(), x.float() @ reference.T + layer.bias.float(), rtol=2e-2, atol=5e-2)
    assert calls == [1, 3]  # 4 and 16 rows stay on oneDNN


@bf16_kernel
def test_without_small_batches_the_plain_weight_is_freed():
    layer = packed_linear(small_batches=False)
    assert layer.weight is None and layer.packed is not None and not layer.small_batches
    assert packed_linear(small_batches=True, k=40).weight is None  # K % 32 != 0: kernel cannot serve it


@bf16_kernel
def test_model_keeps_copies_only_within_the_memory_share(monkeypatch, llama_dir):
    from folio.loader.model_loader import load_model

    def linears(net):
        return {name: m for name, m in net.named_modules() if isinstance(m, Linear)}

    net = load_model(llama_dir, torch.bfloat16, None).model
    assert all(m.small_batches and m.weight is not None for m in linears(net).values())

    monkeypatch.setattr(small_batch_gemm, "MAX_MEMORY_FRACTION", 0.0)
    net = load_model(llama_dir, torch.bfloat16, None).model
    for name, m in linears(net).items():
        assert m.packed is not None
        assert (m.weight is not None) == (m.small_batches is True) == (name == "lm_head" and net.config.tie_word_embeddings)


@f32_kernel
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (5, 96), (37, 100), (1000, 576), (9, 4864)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_the_exact_product(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = small_batch_gemm.linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 FMAs in another order than MKL's: the error of a float32 dot product of k terms, no more
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    assert bool(((got.double() - exact).abs() <= bound).all())


@f32_kernel
def test_float32_strided_rows_and_errors():
    x = torch.randn(3, 200)[:, :100]  # row stride 200
    w = torch.randn(8, 100)
    assert torch.equal(small_batch_gemm.linear(x, w, None), small_batch_gemm.linear(x.contiguous(), w, None))
    with pytest.raises(RuntimeError, match="M <= 8"):
        small_batch_gemm.linear(torch.randn(9, 100), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        small_batch_gemm.linear(x, torch.randn(100, 8).T, None)


@f32_kernel
def test_float32_layers_send_up_to_eight_rows_to_the_kernel(monkeypatch):
    layer = Linear(100, 48, bias=True, params_dtype=torch.float32)
    method = DenseLinearMethod(keep_copies=False)
    layer.bind(method)
    layer.weight.data.copy_(torch.randn(48, 100))
    layer.bias.data.copy_(torch.randn(48))
    method.process_weights_after_loading(layer)
    assert layer.small_batches and layer.packed is None and layer.weight is not None  # no copy: the plain weight
    calls = []
    real = small_batch_gemm.linear
    monkeypatch.setattr(small_batch_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 8, 9, 64):
        x = torch.randn(m, 100)
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-4)
    assert calls == [1, 8]  # 9 and 64 rows stay on MKL
