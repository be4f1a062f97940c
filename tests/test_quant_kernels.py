"""The quantised matmul kernels against their torch references (folio.models.quant_reference), on every
instruction set compiled here and on the shapes of the supported models (SmolLM2-135M, Qwen2-0.5B) plus odd
ones.

Tolerances: W8A8 sums integers and then does the reference's float32 operations in its order, so it is equal
bit for bit. Weight-only kernels sum float32 products in another order than the float64 reference: the
error is bounded by K float32 roundings of the sum of |products|, in practice far less, and each result
must lie within WEIGHT_ONLY_RTOL of (|x| @ |W|^T).
"""

from __future__ import annotations

import pytest
import torch

from folio.models import onednn_layout, quant_kernels
from folio.models import quant_reference as ref

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="needs the quantised linear kernel built")

ISAS = quant_kernels.isas()
WEIGHT_ONLY_RTOL = 2e-6
# (N, K) of every linear layer but the lm_heads: SmolLM2-135M (qkv, o, gate_up, down), Qwen2-0.5B (same),
# then odd ones: one row, rows that fill no tile, K of one block and of an odd number of blocks
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1152, 896), (896, 896), (9728, 896), (896, 4864),
          (1, 32), (7, 96), (33, 160), (101, 224)]
ROWS = [1, 2, 3, 4, 5, 17]


def _data(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _check_weight_only(x, w, scales, offsets, bias) -> None:
    """Every compiled instruction set, every number of rows (the reference is computed once: rows are
    independent), with a bias on odd row counts; x in float32, then in bf16 (which AVX512-BF16 multiplies in
    bf16: products exact, so the same bound plus the output's rounding to bf16)."""
    for x, rounding in ((x, 0.0), (x.bfloat16(), 2 ** -8)):
        for with_bias in (False, True):
            b = bias if with_bias else None
            want = ref.weight_only_linear(x.float(), w, scales, offsets, b, compute_dtype=torch.float64)
            bound = (WEIGHT_ONLY_RTOL * (x.double().abs() @ ref.dequantize(w, scales, offsets).double().abs().T)
                     + rounding * want.abs() + 1e-6)
            for isa in ISAS:
                for m in ROWS:
                    if m % 2 == with_bias:
                        got = quant_kernels.weight_only_linear(x[:m], w, scales, offsets, b, isa)
                        assert got.dtype == x.dtype and got.shape == (m, w.shape[0])
                        assert bool(((got.double() - want[:m]).abs() <= bound[:m]).all()), (isa, m, x.dtype)


@pytest.mark.parametrize("n,k", SHAPES)
def test_weight_only_int8_per_channel_and_groups_of_32(n, k):
    x, w, bias = _data(max(ROWS), n, k, seed=n + k)
    for group in (k, 32):
        _check_weight_only(x, *ref.quantize_int8(w, group), None, bias)


@pytest.mark.parametrize("n,k", SHAPES)
def test_weight_only_int4_groups_of_128_and_32(n, k):
    x, w, bias = _data(max(ROWS), n, k, seed=n * k)
    for group in {32, 128 if k % 128 == 0 else 32}:
        _check_weight_only(x, *ref.quantize_int4(w, group), bias)


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_equals_the_reference_bit_for_bit(n, k):
    x, w, bias = _data(max(ROWS), n, k, seed=3 * n + k)
    x[1] = 0  # a zero row: scale 1, all products 0
    q, scales = ref.quantize_int8(w, k)
    for b, rotated in ((None, False), (bias, False), (bias, True)):
        want = ref.w8a8_linear(x, q, scales.view(-1), b, rotated)
        for isa in ISAS:
            for m in ROWS:
                got = quant_kernels.w8a8_linear(x[:m], q, scales.view(-1), b, rotated, isa=isa)
                assert torch.equal(got, want[:m]), (isa, m, rotated)


# and rotation blocks of 1024, 512 (2560 = 5 x 512) and 4096 values: twelve stages, most between vectors
@pytest.mark.parametrize("n,k", SHAPES + [(1, 1024), (1, 2560), (1, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_unsigned_row_quantiser_equals_the_reference_bit_for_bit(n, k, dtype):
    """The oneDNN path's activations: the reference's codes (rotated or not) + 128, and its scales."""
    x, _, _ = _data(max(ROWS), n, k, seed=11 * n + k)
    x = x.to(dtype)
    x[1] = 0
    x[2] *= 1e-39  # below quant_reference.MIN_SPAN_MAX: 127 / max |x| would overflow
    for rotated in (False, True):
        codes, scales = quant_kernels.quantize_rows_unsigned(x, rotated)
        want_codes, want_scales = ref.quantize_rows(ref.rotate(x) if rotated else x)
        assert codes.dtype == torch.uint8 and torch.equal(codes.int() - 128, want_codes.int())
        assert torch.equal(scales, want_scales)


def test_codes_near_a_half_equal_the_reference():
    """The kernel decides a code from the float32 product x * (127 / a) unless it lies within a margin of a half
    (span_scale.h, span_codes_fast): values whose exact codes are halves, or a hair either side of one, must still
    round as the reference's float64 product does, in rows whose scale is not a power of two."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for a in (3.0, 0.7131, 1e-3 * 1.2345, 41.9):
        inverse = 127 / torch.tensor(a, dtype=torch.float64)
        halves = torch.arange(-126, 127, dtype=torch.float64) + 0.5
        for offset in (0.0, 1e-7, -1e-7, 2e-6, -2e-6, 1.6e-5, -1.6e-5, 3.2e-5, -3.2e-5, 1e-4, -1e-4):
            row = ((halves + offset) / inverse).float()
            row = torch.cat([row, torch.rand(63, generator=gen, dtype=torch.float64).float() * a,
                             torch.tensor([a], dtype=torch.float32)])  # 317 values, a the largest
            rows.append(row[torch.randperm(row.numel(), generator=gen)])
    x = torch.stack(rows)
    codes, scales = quant_kernels.quantize_rows_unsigned(x, False)
    want_codes, want_scales = ref.quantize_rows(x)
    assert torch.equal(codes.int() - 128, want_codes.int()) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("n", [1, 15, 16, 151, 4864])
def test_scale_rows_equals_torch(n):
    gen = torch.Generator().manual_seed(n)
    y, row_scales, bias = torch.randn(9, n, generator=gen), torch.rand(9, generator=gen), torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        for b in (None, bias):
            out = torch.empty(9, n, dtype=dtype)
            quant_kernels.scale_rows(y, row_scales, b, out)
            want = y * row_scales[:, None]
            assert torch.equal(out, (want if b is None else want + b).to(dtype)), (dtype, b is None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_w4a8_equals_the_reference_to_float32_rounding(n, k):
    """int4 . int8 block sums are exact in both; the kernel then sums scaled blocks in float32 (the reference in
    float64), so results differ by float32 rounding of the scaled sums only."""
    x, w, bias = _data(max(ROWS), n, k, seed=5 * n + k)
    x[1] = 0  # a zero row: every block's scale 1, all products 0
    for group in {32, 128 if k % 128 == 0 else 32}:
        packed, scales, offsets = ref.quantize_int4(w, group)
        for b in (None, bias):
            want = ref.w4a8_linear(x.double(), packed, scales, offsets, None if b is None else b.double())
            xq, xs = ref.quantize_blocks(x)
            terms = (xq.double().abs() * xs.double().repeat_interleave(32, dim=1)) @ \
                ref.dequantize(packed, scales, offsets).double().abs().T
            bound = WEIGHT_ONLY_RTOL * (terms + x.double().abs() @ offsets.double().abs().repeat_interleave(
                k // offsets.shape[1], dim=1).T) + 1e-6
            for isa in ISAS:
                for m in ROWS:
                    got = quant_kernels.w4a8_linear(x[:m], packed, scales, offsets, b, isa)
                    assert got.dtype == x.dtype and got.shape == (m, n)
                    assert bool(((got.double() - want[:m]).abs() <= bound[:m]).all()), (isa, m, group)


def test_w4a8_quantises_activations_per_block_of_32():
    x = torch.randn(3, 96) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(32)  # blocks of very different size
    q, s = ref.quantize_blocks(x)
    assert q.dtype == torch.int8 and s.shape == (3, 3)
    assert bool((q.abs().reshape(3, 3, 32).amax(dim=2) == 127).all())  # each block uses its whole range
    err = (q.float() * s.repeat_interleave(32, dim=1) - x).abs()
    assert bool((err <= s.repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_round_the_float32_result_once(isa):
    """W8A8 and W4A8 quantise bf16 rows as their float32 values: the same int sums, the same float32 result,
    rounded once (weight-only ones may multiply in bf16: _check_weight_only bounds them)."""
    x, w, bias = _data(5, 48, 128, seed=7)
    xb = x.to(torch.bfloat16)
    q, scales = ref.quantize_int8(w, 128)
    packed, s4, o4 = ref.quantize_int4(w, 32)
    pairs = [(lambda a: quant_kernels.w8a8_linear(a, q, scales.view(-1), bias, isa=isa)),
             (lambda a: quant_kernels.w8a8_linear(a, q, scales.view(-1), bias, True, isa=isa)),
             (lambda a: quant_kernels.w4a8_linear(a, packed, s4, o4, bias, isa))]
    for run in pairs:
        got = run(xb)
        assert got.dtype == torch.bfloat16 and torch.equal(got, run(xb.float()).to(torch.bfloat16))


def test_quantisers_round_to_the_nearest_grid_point():
    w = torch.randn(6, 256) * 3
    q, scales = ref.quantize_int8(w, 64)
    err = (ref.dequantize(q, scales, None) - w).abs().reshape(6, 4, 64)
    assert bool((err <= scales[..., None] / 2 * (1 + 1e-6)).all()) and int(q.abs().max()) == 127
    packed, s4, o4 = ref.quantize_int4(w, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 128)
    err = (ref.dequantize(packed, s4, o4) - w).abs().reshape(6, 8, 32)
    # scale and offset on float16's grid: the top of a group may lie past the last point by 15 scale roundings
    assert bool((err <= s4[..., None] / 2 * (1 + 1e-5) + 2 ** -11 * (o4.abs() + 15 * s4)[..., None]).all())
    assert torch.equal(s4.half().float(), s4) and torch.equal(o4.half().float(), o4)
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(codes)), codes)
    assert ref.pack_int4(codes)[0, 0] == codes[0, 0] | (codes[0, 16] << 4)  # llama.cpp's Q4_0 nibble order


def test_bad_shapes_are_refused():
    q = torch.zeros(4, 40, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_kernels.weight_only_linear(torch.randn(1, 40), q, torch.ones(4, 1), None, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_kernels.w8a8_linear(torch.randn(1, 40), q, torch.ones(4), None)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        quant_kernels.weight_only_linear(torch.randn(1, 32), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1),
                                         None, None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_dequantize_equals_the_reference_to_one_rounding(n, k):
    """q * scale (+ offset) as the reference computes it; the kernel may fuse the multiply and the add (one
    rounding fewer), so each value lies within a float32 rounding of |q * scale| + |offset| of it."""
    _, w, _ = _data(1, n, k, seed=11 * n + k)
    for packed, scales, offsets in (ref.quantize_int8(w, k) + (None,), ref.quantize_int8(w, 32) + (None,),
                                    ref.quantize_int4(w, 32), ref.quantize_int4(w, 128 if k % 128 == 0 else 32)):
        want = ref.dequantize(packed, scales, offsets)
        group = k // scales.shape[1]
        codes = (packed if offsets is None else ref.unpack_int4(packed)).float()
        size = codes.abs() * scales.repeat_interleave(group, dim=1)
        if offsets is not None:
            size += offsets.abs().repeat_interleave(group, dim=1)
        for isa in ISAS:
            got = quant_kernels.dequantize(packed, scales, offsets, isa=isa)
            assert got.dtype == torch.float32 and got.shape == (n, k)
            assert bool(((got - want).abs() <= 2 ** -23 * size).all()), isa
            # bf16: the kernel's float32 values, rounded once to nearest even
            assert torch.equal(quant_kernels.dequantize(packed, scales, offsets, torch.bfloat16, isa), got.bfloat16())


@pytest.mark.parametrize("n,k", [(9728, 896), (896, 4864), (33, 160), (101, 224)])
def test_a_prefill_sized_batch_runs_the_packed_scratch(n, k):
    """From dequantize_min_rows rows a bf16 weight-only layer writes its weight into the packed scratch of its shape
    (in bf16, the values `dequantize` gives, at every instruction set), and oneDNN's GEMM on it equals that GEMM on
    the dequantised weight packed by oneDNN itself, bit for bit."""
    from folio.models import packed_scratch
    from folio.models.int8_linear import Int8LinearMethod
    from folio.models.linear import Linear
    from folio.models.quantized_linear import dequantize_min_rows

    scratch = packed_scratch.for_shape(n, k)
    if scratch is None:
        pytest.skip("oneDNN cannot pack bf16 here, or lays it out otherwise")
    _, w, bias = _data(1, n, k, seed=5 * n + k)
    for packed, scales, offsets in (ref.quantize_int8(w, 32) + (None,), ref.quantize_int4(w, 32)):
        want = quant_kernels.dequantize(packed, scales, offsets, torch.bfloat16)
        by_onednn = onednn_layout.vnni_blocks(torch.ops.mkldnn._reorder_linear_weight(want, 64), want, 2)
        for isa in ISAS:
            scratch.blocks.zero_()  # the padding oneDNN leaves zero, which the kernel does not write
            quant_kernels.dequantize_packed(packed, scales, offsets, scratch.blocks, isa)
            assert torch.equal(scratch.blocks, by_onednn), isa
    layer = Linear(k, n, bias=True, params_dtype=torch.bfloat16)
    method = Int8LinearMethod()  # weight-only: GGUF's Q8_0 layers, w8a16's without VNNI
    layer.bind(method)
    layer.weight.weight_loader(layer.weight, w, None)
    layer.bias.data.copy_(bias)
    method.process_weights_after_loading(layer)
    x = torch.randn(dequantize_min_rows(torch.bfloat16) + 3, k).bfloat16()
    weight = quant_kernels.dequantize(layer.weight, layer.weight_scale, None, torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    want = torch.ops.mkldnn._linear_pointwise(x, onednn, layer.bias.bfloat16(), "none", [], "")
    assert torch.equal(layer(x), want)
