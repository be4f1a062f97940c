"""W8A8 in oneDNN's int8 GEMM (folio.models.onednn_int8) against the torch reference (quant_reference.w8a8_linear),
and its use by int8 layers; the same for int16 activations (quant_reference.w8_int16_linear: two GEMMs, one per
byte of the codes, and folio's kernel that reads the packed weight for few rows).

The int32 sums are exact on both sides; the result differs from the reference only by the order of the two
float32 scalings (a couple of float32 roundings), then once more by the output's rounding to bf16. Without VNNI,
oneDNN pairs products in int16 with saturation, so there the weights are kept within 6 bits (the source is
unsigned, up to 255); CPUs with VNNI or AMX (where the path is used) run the full range too.
"""

from __future__ import annotations

import pytest
import torch

from folio.models import fused_ops, gated_layout, onednn_int8, quant_kernels
from folio.models import quant_reference as ref
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear
from folio.platforms.cpu_features import cpu_flags, has_amx_int8

pytestmark = pytest.mark.skipif(not onednn_int8.available(), reason="this PyTorch has no oneDNN int8 linear")
EXACT_PAIRS = not {"avx512_vnni", "avx_vnni", "amx_int8"}.isdisjoint(cpu_flags().split())
WEIGHT_RANGES = [63, pytest.param(127, marks=pytest.mark.skipif(not EXACT_PAIRS, reason="int16 pairs saturate"))]
CHUNKED = onednn_int8.CHUNK_ROWS + 44  # two oneDNN calls, the second of a partial chunk
packed_kernel = pytest.mark.skipif(not quant_kernels.has_packed_w8a8(), reason="the packed W8A8 kernel needs VNNI")
# the packed products on the kernel's vector loop, and on the tiles: folio's AMX tile loop where the CPU has
# AMX-INT8 and K is a multiple of 64, else brgemm's (AMX's or VNNI's)
TILES = [False, pytest.param(True, marks=pytest.mark.skipif(not quant_kernels.has_w8a8_tiles(),
                                                             reason="this PyTorch's brgemm has no int8 product"))]


def check_close(out: torch.Tensor, expected: torch.Tensor, atol_of_largest: float = 0.0) -> None:
    """Within bf16's rounding, or float32's; atol_of_largest: also within that fraction of the largest value."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -21
    atol = max(1e-6, atol_of_largest * float(expected.abs().max()))
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


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
@pytest.mark.parametrize("tiles", TILES, ids=["vectors", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 151, 896), (15, 1152, 896), (5, 896, 4864), (2, 100, 96),
                                   (1, 1, 32), (64, 200, 896), (17, 1152, 896), (33, 896, 4864), (48, 151, 576),
                                   (20, 70, 96), (80, 151, 576), (97, 1152, 896), (161, 896, 4864), (300, 70, 128)])
def test_the_packed_kernel_equals_the_reference_bit_for_bit(m, n, k, dtype, rotated, tiles):
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
        got = quant_kernels.w8a8_packed_linear(x, packed.blocks, packed.column_sums, packed.scales, b, rotated,
                                               tiles)
        assert torch.equal(got, ref.w8a8_linear(x, weight, scales, b, rotated))


@packed_kernel
@pytest.mark.parametrize("tiles", TILES, ids=["vectors", "tiles"])
def test_the_packed_kernel_reads_padded_blocks_and_checks_shapes(tiles):
    n, k, padded_k = 70, 64, 128
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    plain = torch.zeros(128, padded_k, dtype=torch.int8)
    plain[:n, :k] = weight
    blocks = plain.view(2, 64, padded_k // 4, 4).transpose(1, 2).contiguous()
    scales, sums = torch.rand(n) + 0.1, weight.sum(dim=1, dtype=torch.int32)
    x = torch.randn(3, k)
    got = quant_kernels.w8a8_packed_linear(x, blocks, sums, scales, None, False, tiles)
    assert torch.equal(got, ref.w8a8_linear(x, weight, scales, None))
    with pytest.raises(RuntimeError, match="within the blocks' K"):
        quant_kernels.w8a8_packed_linear(torch.randn(1, 132), blocks, sums, scales, None, False, tiles)
    with pytest.raises(RuntimeError, match="within the last block"):
        quant_kernels.w8a8_packed_linear(x, blocks, torch.zeros(130, dtype=torch.int32), torch.ones(130), None, False,
                                         tiles)


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


@pytest.mark.parametrize("tile_rows", [None, 0, 40])  # as prepacked here, none, up to 40 (AMX-INT8's rule)
def test_w8a8_layers_run_every_batch_on_the_packed_weight(monkeypatch, tile_rows):
    """Many rows in oneDNN, few in the kernel that reads oneDNN's copy where there is one (the layer frees its
    own), else in folio's row-major kernel; with AMX-INT8 those between on the tiles."""
    layer, weight = _w8a8_layer(onednn=True)
    packed = layer.onednn_weight
    assert packed is not None
    assert (layer.weight is None) == (packed.blocks is not None) == quant_kernels.has_packed_w8a8()
    if tile_rows is not None:
        if tile_rows and not quant_kernels.has_w8a8_tiles():
            pytest.skip("this PyTorch's brgemm has no int8 product")
        packed.tile_rows = tile_rows
    onednn_calls = []
    qlinear = torch.ops.onednn.qlinear_pointwise
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise",
                        lambda x, *rest: (onednn_calls.append(x.shape[0]), qlinear(x, *rest))[1], raising=False)
    for rows in (1, packed.min_rows - 1, packed.min_rows, 40, 100):
        x = torch.randn(rows, 64)
        got, expected = layer(x), ref.w8a8_linear(x, weight, layer.weight_scale.view(-1), layer.bias, True)
        if rows < packed.min_rows and packed.blocks is not None or rows <= packed.tile_rows:
            assert torch.equal(got, expected)
        else:
            check_close(got, expected)
    assert onednn_calls == [rows for rows in (packed.min_rows, 40, 100) if rows > packed.tile_rows]


@pytest.mark.skipif(not (has_amx_int8() and quant_kernels.has_w8a8_tiles()), reason="needs AMX-INT8 and the tiles")
def test_on_amx_the_tile_loop_takes_every_batch_where_it_runs():
    """Prefill chunks too (its gemm); layers whose K it cannot take keep brgemm's tiles for up to 128 rows only."""
    weight, scales = torch.randint(-127, 128, (96, 128), dtype=torch.int8), torch.rand(96) * 0.01
    assert onednn_int8.prepack(weight, scales).tile_rows == (
        onednn_int8.TILE_ROWS_AMX if quant_kernels.has_w8a8_amx() else onednn_int8.BRGEMM_ROWS_AMX)
    assert onednn_int8.prepack(weight[:, :96].contiguous(), scales).tile_rows == onednn_int8.BRGEMM_ROWS_AMX


def test_default_follows_the_cpu():
    assert Int8LinearMethod(int8_activations=True).onednn == onednn_int8.usable()
    assert onednn_int8.usable() == (onednn_int8.available() and not {"avx512_vnni", "amx_int8"}.isdisjoint(
        cpu_flags().split()))
    assert not Int8LinearMethod(int8_activations=False, onednn=True).onednn  # weight-only: no int8 activations
    layer, weight = _w8a8_layer(onednn=False)
    assert layer.onednn_weight is None and torch.equal(layer.weight, weight)


def _int16_case(m: int, n: int, k: int, dtype: torch.dtype, weight_range: int = 127):
    """An int8 weight with per-channel scales, a bias, and rows of x with outliers and a zero row."""
    gen = torch.Generator().manual_seed(m + n + k)
    weight = torch.randint(-weight_range, weight_range + 1, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen) * 3
    x[:, :3] *= 100  # outlier channels, as final hidden states have
    x[-1] = 0  # a zero row (scale 1)
    return weight, scales, torch.randn(n, generator=gen), x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int16_codes_are_within_half_a_step(dtype, monkeypatch):
    x = _int16_case(5, 1, 896, dtype)[3]
    codes, scales = ref.quantize_rows_int16(x)
    assert int(codes.abs().max()) == ref.INT16_CODE_MAX and torch.equal(codes[-1], torch.zeros_like(codes[-1]))
    assert bool(((codes * scales[:, None] - x.float()).abs() <= scales[:, None] / 2 * (1 + 2 ** -20)).all())
    high, low = ref.split_int16(codes)
    assert torch.equal(256 * high + low, codes)
    assert int(high.abs().max()) <= 127 and int(low.min()) >= -128 and int(low.max()) <= 127
    for kernel in (True, False):  # the kernel's quantiser, then the reference's where it is absent
        if not kernel:
            monkeypatch.setattr(quant_kernels.KERNEL, "load", lambda: None)
        high_codes, low_codes, row_scales = quant_kernels.quantize_rows_int16_bytes(x)
        assert high_codes.dtype == low_codes.dtype == torch.uint8 and torch.equal(row_scales, scales)
        assert torch.equal(high_codes.int() - 128, high) and torch.equal(low_codes.int() - 128, low)


def test_the_int16_reference_is_the_exact_product_within_its_roundings():
    """|error| <= sum_k |w_k| * (half a step of x's codes) * weight scale, plus float32's roundings."""
    weight, scales, _, x = _int16_case(4, 300, 896, torch.float32)
    got = ref.w8_int16_linear(x, weight, scales, None).double()
    exact = x.double() @ (weight.double() * scales.double()[:, None]).T
    _, sx = ref.quantize_rows_int16(x)
    bound = sx.double()[:, None] / 2 * (weight.double().abs().sum(dim=1) * scales.double())[None, :]
    bound = bound + exact.abs() * 2 ** -21 + 1e-9
    assert bool(((got - exact).abs() <= bound).all())
    # what it is for: far closer to the float product than W8A8's int8 codes
    w8a8 = ref.w8a8_linear(x, weight, scales, None).double()
    assert float((got - exact).abs().mean()) * 30 < float((w8a8 - exact).abs().mean())


@packed_kernel
@pytest.mark.parametrize("tiles", TILES, ids=["vectors", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (2, 151, 896), (3, 1152, 896), (1, 896, 4864), (2, 100, 96),
                                   (1, 1, 32), (7, 200, 128), (40, 130, 896), (16, 200, 128), (64, 151, 576),
                                   (97, 130, 896), (161, 200, 128)])
def test_the_int16_kernel_equals_the_reference_bit_for_bit(m, n, k, dtype, tiles):
    """Both bytes' sums exact, 256 * high + low rounded once, the reference's float32 scalings; rows two at a
    time (a partial pair for odd counts)."""
    weight, scales, bias, x = _int16_case(m, n, k, dtype)
    packed = onednn_int8.prepack(weight, scales)
    assert packed.blocks is not None, "oneDNN chose a layout the kernel does not read"
    for b in (bias, None):
        got = quant_kernels.w8_int16_packed_linear(x, packed.blocks, packed.column_sums, packed.scales, b, tiles)
        assert torch.equal(got, ref.w8_int16_linear(x, weight, scales, b))


@pytest.mark.parametrize("weight_range", WEIGHT_RANGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(16, 64, 64), (37, 151, 896), (CHUNKED, 896, 4864)])
def test_int16_activations_in_onednn_match_the_reference(m, n, k, dtype, weight_range, monkeypatch):
    """Two GEMMs per chunk of rows (each byte of the codes + 128, with a zero point of 128), combined and scaled
    in float32 in another order than the reference's: each byte's sum is scaled and rounded before 256 high +
    low, so where they cancel a float32 result differs by float32 roundings of the larger ones (2^-21 of the
    largest value)."""
    weight, scales, bias, x = _int16_case(m, n, k, dtype, weight_range)
    packed = onednn_int8.prepack(weight, scales)
    calls = []
    qlinear = torch.ops.onednn.qlinear_pointwise
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise",
                        lambda codes, scale, zero_point, *rest: (calls.append((codes.shape[0], zero_point)),
                                                                 qlinear(codes, scale, zero_point, *rest))[1],
                        raising=False)
    check_close(onednn_int8.linear_int16(x, packed, bias), ref.w8_int16_linear(x, weight, scales, bias), 2 ** -21)
    chunks = [min(onednn_int8.CHUNK_ROWS, m - start) for start in range(0, m, onednn_int8.CHUNK_ROWS)]
    expected = [(rows, 128) for rows in chunks] * 2
    if packed.blocks is not None and m < packed.min_rows or m <= packed.tile_rows:
        expected = []  # folio's kernel, or the tiles
    assert sorted(calls) == sorted(expected)


def test_int16_layers_take_the_kernel_then_onednn_or_run_weight_only_without_it():
    with pytest.raises(ValueError, match="exclude each other"):
        Int8LinearMethod(int8_activations=True, int16_activations=True)
    for onednn in (True, False):
        layer = Linear(96, 130, bias=True, params_dtype=torch.bfloat16)
        method = Int8LinearMethod(int16_activations=True, onednn=onednn)
        layer.bind(method)
        gen = torch.Generator().manual_seed(1)
        layer.weight.weight_loader(layer.weight, torch.randn(130, 96, generator=gen), None)
        layer.bias.weight_loader(layer.bias, torch.randn(130, generator=gen), None)
        if onednn and not EXACT_PAIRS:  # within 7 bits (see the module docstring)
            layer.weight.data.copy_(torch.randint(-63, 64, layer.weight.shape, generator=gen, dtype=torch.int8))
        weight = layer.weight.detach().clone()
        method.process_weights_after_loading(layer)
        scales = layer.weight_scale.view(-1)
        for rows in (1, 3, 40):
            x = torch.randn(rows, 96, generator=gen).bfloat16()
            got = layer(x)
            if not onednn:  # weight-only: bf16 activations (the kernel, or from 8 rows the dequantised GEMM)
                want = ref.weight_only_linear(x, weight, layer.weight_scale, None, layer.bias).float()
                torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=2 ** -7 * float(want.abs().max()))
            elif rows < layer.onednn_weight.min_rows and layer.onednn_weight.blocks is not None:
                assert torch.equal(got, ref.w8_int16_linear(x, weight, scales, layer.bias))
            else:
                check_close(got, ref.w8_int16_linear(x, weight, scales, layer.bias), 2 ** -21)


silu_table = pytest.mark.skipif(fused_ops.bf16_silu_table() is None, reason="bf16 SiLU-and-mul uses no table here")


@packed_kernel
@silu_table
@pytest.mark.parametrize("tiles", TILES, ids=["vectors", "tiles"])
@pytest.mark.parametrize("codes", ["int8", "int8-rotated", "int16"])
@pytest.mark.parametrize("m,i,k", [(1, 64, 64), (3, 128, 896), (17, 64, 128), (48, 192, 128), (62, 128, 256),
                                   (64, 64, 64), (100, 128, 128), (300, 64, 192)])
def test_a_gated_product_is_silu_and_mul_of_the_plain_one_bit_for_bit(m, i, k, codes, tiles):
    """A gate/up weight with its rows interleaved for the epilogue's SiLU-and-mul gives what silu_and_mul gives on
    the plain weight's product, on every path of the kernel (rows one or two at a time, blocks, panels, gemm)."""
    weight, scales, _, x = _int16_case(m, 2 * i, k, torch.bfloat16)
    x[1 % m] = float("nan")  # a NaN gate row, rounded as the op rounds it (and a zero row: _int16_case)
    plain = onednn_int8.prepack(weight, scales)
    interleaved = onednn_int8.prepack(gated_layout.interleave_gated(weight), gated_layout.interleave_gated(scales))
    table = fused_ops.bf16_silu_table()
    if codes == "int16":
        product = lambda w, t=None: quant_kernels.w8_int16_packed_linear(x, w.blocks, w.column_sums, w.scales, None,
                                                                         tiles, t)
    else:
        product = lambda w, t=None: quant_kernels.w8a8_packed_linear(x, w.blocks, w.column_sums, w.scales, None,
                                                                     codes == "int8-rotated", tiles, t)
    expected = fused_ops.silu_and_mul(product(plain))
    got = product(interleaved, table)
    assert got.shape == (m, i) and torch.equal(got.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(RuntimeError, match="gated product takes bf16 x"):
        quant_kernels.w8a8_packed_linear(x.float(), plain.blocks, plain.column_sums, plain.scales, None, False,
                                         tiles, table)


@pytest.mark.parametrize("int16", [False, True], ids=["w8a8", "int16"])
def test_a_swiglu_int8_layer_fuses_silu_and_mul_where_every_batch_runs_on_folios_epilogue(int16):
    """A bf16 gate/up layer (Linear's silu_and_mul) gives what the same layer without it gives, then silu_and_mul,
    bit for bit at every batch size; its weight is gated on AMX-INT8 with folio's tile loop, else packed as it is."""
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(128, 256, generator=gen) * 0.05 for _ in range(2)]
    layers = []
    for fused in (True, False):
        layer = Linear(256, {0: 128, 1: 128}, params_dtype=torch.bfloat16, silu_and_mul=fused)
        method = Int8LinearMethod(int8_activations=not int16, rotated=not int16, int16_activations=int16)
        layer.bind(method)
        for shard, weight in enumerate(weights):
            layer.weight.weight_loader(layer.weight, weight, shard)
        method.process_weights_after_loading(layer)
        layers.append(layer)
    gated, plain = layers
    every_batch_on_the_epilogue = (onednn_int8.usable() and has_amx_int8() and quant_kernels.has_w8a8_amx()
                                   and fused_ops.bf16_silu_table() is not None)
    assert (gated.onednn_weight is not None and gated.onednn_weight.silu_table is not None) == \
        every_batch_on_the_epilogue
    for rows in (1, 2, 3, 4, 40, 64, 100, 300):
        x = (torch.randn(rows, 256, generator=gen) * 2).bfloat16()
        assert torch.equal(gated(x).view(torch.int16), fused_ops.silu_and_mul(plain(x)).view(torch.int16))
    assert gated(x.view(3, 100, 256)).shape == (3, 100, 128)
