"""W8A8 in oneDNN's int8 GEMM (folio.models.onednn_int8) against the torch reference (quant_reference.w8a8_linear),
and its use by int8 layers.

The int32 sums are exact on both sides; the result differs from the reference only by the order of the two
float32 scalings (a couple of float32 roundings), then once more by the output's rounding to bf16. Without VNNI,
oneDNN pairs products in int16 with saturation, so there the weights are kept within 6 bits (the source is
unsigned, up to 255); CPUs with VNNI or AMX (where the path is used) run the full range too.
"""

from __future__ import annotations

import pytest
import torch

from folio.models import onednn_int8, quant_kernels
from folio.models import quant_reference as ref
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear
from folio.platforms.cpu_features import cpu_flags

pytestmark = pytest.mark.skipif(not onednn_int8.available(), reason="this PyTorch has no oneDNN int8 linear")
EXACT_PAIRS = not {"avx512_vnni", "avx_vnni", "amx_int8"}.isdisjoint(cpu_flags().split())
WEIGHT_RANGES = [63, pytest.param(127, marks=pytest.mark.skipif(not EXACT_PAIRS, reason="int16 pairs saturate"))]
CHUNKED = onednn_int8.CHUNK_ROWS + 44  # two oneDNN calls, the second of a partial chunk
packed_kernel = pytest.mark.skipif(not quant_kernels.has_packed_w8a8(), reason="the packed W8A8 kernel needs VNNI")


def check_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -21
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("weight_range", WEIGHT_RANGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("m,n,k", [(16, 64, 64), (37, 151, 896), (CHUNKED, 896, 4864), (64, 4864, 896)])
def test_matches_the_reference(m, n, k, dtype, weight_range, rotated):
    gen = torch.Generator().manual_seed(m + n + k)
    weight = torch.randint(-weight_range, weight_range + 1, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0] = 0  # a zero row (scale 1)
    packed = onednn_int8.prepack(weight, scales)
    check_close(onednn_int8.linear(x, packed, bias, rotated), ref.w8a8_linear(x, weight, scales, bias, rotated))
    check_close(onednn_int8.linear(x, packed, None, rotated), ref.w8a8_linear(x, weight, scales, None, rotated))


@packed_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 151, 896), (15, 1152, 896), (5, 896, 4864), (2, 100, 96),
                                   (1, 1, 32)])
def test_the_packed_kernel_equals_the_reference_bit_for_bit(m, n, k, dtype, rotated):
    """Small batches read oneDNN's packed weight in place; exact sums, the reference's float32 scalings."""
    gen = torch.Generator().manual_seed(m + n + k)
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, :5] = 40  # an outlier
    packed = onednn_int8.prepack(weight, scales)
    assert packed.blocks is not None, "oneDNN chose a layout the kernel does not read"
    for b in (bias, None):
        got = quant_kernels.w8a8_packed_linear(x, packed.blocks, packed.column_sums, packed.scales, b, rotated)
        assert torch.equal(got, ref.w8a8_linear(x, weight, scales, b, rotated))


@packed_kernel
def test_the_packed_kernel_reads_padded_blocks_and_checks_shapes():
    n, k, padded_k = 70, 64, 128
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    plain = torch.zeros(128, padded_k, dtype=torch.int8)
    plain[:n, :k] = weight
    blocks = plain.view(2, 64, padded_k // 4, 4).transpose(1, 2).contiguous()
    scales, sums = torch.rand(n) + 0.1, weight.sum(dim=1, dtype=torch.int32)
    x = torch.randn(3, k)
    got = quant_kernels.w8a8_packed_linear(x, blocks, sums, scales, None, False)
    assert torch.equal(got, ref.w8a8_linear(x, weight, scales, None))
    with pytest.raises(RuntimeError, match="within the blocks' K"):
        quant_kernels.w8a8_packed_linear(torch.randn(1, 132), blocks, sums, scales, None, False)
    with pytest.raises(RuntimeError, match="within the last block"):
        quant_kernels.w8a8_packed_linear(x, blocks, torch.zeros(130, dtype=torch.int32), torch.ones(130), None, False)


def _w8a8_layer(onednn: bool) -> tuple[Linear, torch.Tensor]:
    """A loaded rotated W8A8 layer, and its int8 weight as loaded (the layer may free it for oneDNN's copy)."""
    layer = Linear(64, {"q": 64, "k": 32, "v": 32}, bias=True, params_dtype=torch.float32)
    method = Int8LinearMethod(int8_activations=True, rotated=True, onednn=onednn)
    layer.bind(method)
    gen = torch.Generator().manual_seed(0)
    for shard_id, (_, rows) in layer.shards.items():
        layer.weight.weight_loader(layer.weight, torch.randn(rows, 64, generator=gen), shard_id)
        layer.bias.weight_loader(layer.bias, torch.randn(rows, generator=gen), shard_id)
    if not EXACT_PAIRS:  # within 7 bits (see the module docstring)
        layer.weight.data.copy_(torch.randint(-63, 64, layer.weight.shape, generator=gen, dtype=torch.int8))
    weight = layer.weight.detach().clone()
    method.process_weights_after_loading(layer)
    return layer, weight


def test_w8a8_layers_run_every_batch_on_the_packed_weight(monkeypatch):
    """Many rows in oneDNN, few in the kernel that reads oneDNN's copy where there is one (the layer frees its
    own), else in folio's row-major kernel."""
    layer, weight = _w8a8_layer(onednn=True)
    packed = layer.onednn_weight
    assert packed is not None
    assert (layer.weight is None) == (packed.blocks is not None) == quant_kernels.has_packed_w8a8()
    onednn_calls = []
    qlinear = torch.ops.onednn.qlinear_pointwise
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise",
                        lambda x, *rest: (onednn_calls.append(x.shape[0]), qlinear(x, *rest))[1], raising=False)
    for rows in (1, packed.min_rows - 1, packed.min_rows, 100):
        x = torch.randn(rows, 64)
        got, expected = layer(x), ref.w8a8_linear(x, weight, layer.weight_scale.view(-1), layer.bias, True)
        if rows < packed.min_rows and packed.blocks is not None:
            assert torch.equal(got, expected)
        else:
            check_close(got, expected)
    assert onednn_calls == [packed.min_rows, 100]


def test_default_follows_the_cpu():
    assert Int8LinearMethod(int8_activations=True).onednn == onednn_int8.usable()
    assert onednn_int8.usable() == (onednn_int8.available() and not {"avx512_vnni", "amx_int8"}.isdisjoint(
        cpu_flags().split()))
    assert not Int8LinearMethod(int8_activations=False, onednn=True).onednn  # weight-only: no int8 activations
    layer, weight = _w8a8_layer(onednn=False)
    assert layer.onednn_weight is None and torch.equal(layer.weight, weight)
