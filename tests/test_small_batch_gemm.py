"""The small-batch linear kernel (bf16 and float32): its results, and when the dense linear method and the models
use it."""

from __future__ import annotations

import os

import pytest
import torch

from folio.models import fused_ops, gated_layout, onednn_layout, small_batch_gemm
from folio.models.dense_linear import DenseLinearMethod
from folio.models.linear import Linear

bf16_kernel = pytest.mark.skipif(not small_batch_gemm.available(torch.bfloat16),
                                 reason="the bf16 small-batch kernel needs AVX512-BF16 and a working compiler")
f32_kernel = pytest.mark.skipif(not small_batch_gemm.available(torch.float32),
                                reason="the float32 small-batch kernel needs AVX2+FMA and a working compiler")


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps separate a and b (same-sign values; bf16 bit patterns are ordered like ints)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def packed(w: torch.Tensor) -> small_batch_gemm.PackedWeight:
    """w in oneDNN's packed layout, as the kernel reads it (a float32 weight's layout is oneDNN's choice per CPU:
    the test skips where the kernel does not read it)."""
    weight = small_batch_gemm.packed_blocks(torch.ops.mkldnn._reorder_linear_weight(w, 64), w)
    if weight is None and w.dtype == torch.float32:
        pytest.skip("oneDNN packs float32 weights here in a layout the kernel does not read")
    assert weight is not None, "oneDNN chose a layout the kernel does not read"
    return weight


amx_kernel = pytest.mark.skipif(not (small_batch_gemm.available(torch.bfloat16) and small_batch_gemm.amx_available()),
                                reason="the kernel's AMX tile loop needs a CPU with AMX-BF16")

# the bf16 paths on the packed blocks, each at any batch size: the vector kernel, and where the CPU has AMX the
# kernel's tile loop (K a multiple of 32 only)
BF16_PATHS = {"kernel": small_batch_gemm.vector_linear, "amx": small_batch_gemm.amx_linear}
PATH_PARAMS = pytest.mark.parametrize("path", [pytest.param("kernel", marks=bf16_kernel),
                                               pytest.param("amx", marks=amx_kernel)])
KERNEL_DTYPES = pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=bf16_kernel),
                                                  pytest.param(torch.float32, marks=f32_kernel)])


def takes(path: str, k: int) -> None:
    if path == "amx" and k % 32:
        pytest.skip("the AMX tile loop takes K a multiple of 32 (a tile's depth)")


@PATH_PARAMS
@pytest.mark.parametrize("m", [1, 2, 7, 13, 16, 17, 33, 48, 64, 80, 97, 161])
@pytest.mark.parametrize("n,k", [(1, 2), (5, 96), (1000, 576), (37, 1536), (100, 30), (1152, 896), (896, 4864)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_product_to_one_bf16_step(path, m, n, k, with_bias):
    """Every shape family of the supported models' layers (the 0.5B Qwen2's down projection among them), odd
    widths and row counts that leave a partial tile of rows or an odd number of them (past 64 rows the tile
    loop's gemm: pairs of groups and a last single one)."""
    takes(path, k)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = BF16_PATHS[path](x, packed(w), b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # exact products, float32 sums (error at most k eps32 of the absolute sum), one rounding to bf16 (half a
    # bf16 step: 2^-8 of the value)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0)
    bound = (k + 1) * torch.finfo(torch.float32).eps * magnitude + 2.0 ** -8 * exact.abs() * (1 + 1e-3)
    assert bool(((got.double() - exact).abs() <= bound).all())
    # in practice the correctly rounded result or its neighbour wherever the value is not near zero
    want = exact.to(torch.bfloat16)
    clear = exact.abs() > 1e-2 * magnitude
    assert bool((bf16_ulps_apart(got, want)[clear] <= 1).all())


@PATH_PARAMS
@pytest.mark.parametrize("width", onednn_layout.BLOCK_WIDTHS)
@pytest.mark.parametrize("k,padded_k", [(40, 64), (64, 96)])
def test_every_block_width_and_padded_k(path, width, k, padded_k):
    """Layouts oneDNN may choose on other CPUs: blocks 16 to 64 columns wide, K padded within each block."""
    takes(path, k)
    n = 70
    w = torch.randn(n, k).to(torch.bfloat16)
    num_blocks = -(-n // width)
    plain = torch.zeros(num_blocks * width, padded_k, dtype=torch.bfloat16)
    plain[:n, :k] = w
    blocks = plain.view(num_blocks, width, padded_k // 2, 2).transpose(1, 2).contiguous()
    for m in (9, 40):
        x = torch.randn(m, k).to(torch.bfloat16)
        got = BF16_PATHS[path](x, small_batch_gemm.PackedWeight(blocks, n, k), None)
        assert torch.allclose(got.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-1)


@bf16_kernel
def test_the_packed_view_keeps_onednn_memory_alive_and_rejects_other_layouts():
    w = torch.randn(300, 64).to(torch.bfloat16)
    weight = packed(w)  # the oneDNN tensor is dropped here: the view holds it
    for _ in range(3):
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(300, 64).to(torch.bfloat16), 64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert torch.allclose(small_batch_gemm.linear(x, weight, None).float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-1)
    wrong = torch.ops.mkldnn._reorder_linear_weight(torch.randn(300, 64).to(torch.bfloat16), 64)
    assert small_batch_gemm.packed_blocks(wrong, w) is None  # not this weight's bytes: no layout matches
    assert small_batch_gemm.packed_blocks(torch.ops.mkldnn._reorder_linear_weight(w[:, :63].contiguous(), 64),
                                          w[:, :63]) is None  # odd K


@PATH_PARAMS
def test_strided_rows_and_errors(path):
    linear = BF16_PATHS[path]
    x = torch.randn(20, 128).to(torch.bfloat16)[:, :64]  # row stride 128
    weight = packed(torch.randn(8, 64).to(torch.bfloat16))
    assert torch.equal(linear(x, weight, None), linear(x.contiguous(), weight, None))
    with pytest.raises(RuntimeError, match="within the blocks' K"):
        linear(torch.randn(1, 66).to(torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="within the last block"):
        linear(x, small_batch_gemm.PackedWeight(weight.blocks, 65, 64), None)
    if path == "amx":
        with pytest.raises(RuntimeError, match="multiple of 32"):
            linear(torch.randn(17, 48).to(torch.bfloat16), packed(torch.randn(8, 48).to(torch.bfloat16)), None)


@amx_kernel
def test_amx_tiles_and_pytorch_brgemm_alternate_on_the_same_threads():
    """The tile loop and PyTorch's brgemm (the flash prefill's bf16 products: oneDNN's micro-kernel on AMX) each
    load their own tile configuration on the threads they run on; alternating, neither may multiply with the
    other's tile shapes."""
    from folio.attention import cpu_paged, flash_prefill
    from folio.attention.backend import AttentionParams
    from test_cpu_paged_attention import make_step, run
    from test_flash_prefill import attend_all

    if flash_prefill.KERNEL.load() is None or not flash_prefill.KERNEL.load().has_bf16_products():
        pytest.skip("the flash prefill's bf16 products (brgemm) are not built here")
    q, k, v, cache, layout = make_step([(100, 100), (37, 300)], 16, 2, 7, 64, torch.bfloat16, seed=3)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    x = torch.randn(40, 896).to(torch.bfloat16)
    w = torch.randn(1152, 896).to(torch.bfloat16)
    weight = packed(w)
    want = small_batch_gemm.amx_linear(x, weight, None)
    before = attend_all(q, written, layout, AttentionParams(), bf16_products=True)
    for _ in range(3):
        assert torch.equal(small_batch_gemm.amx_linear(x, weight, None), want)
        assert torch.equal(attend_all(q, written, layout, AttentionParams(), bf16_products=True), before)


def packed_linear(k: int = 64) -> Linear:
    """A bf16 layer on the dense method."""
    layer = Linear(k, 48, bias=True, params_dtype=torch.bfloat16)
    method = DenseLinearMethod()
    layer.bind(method)
    layer.weight.data.copy_(torch.randn(48, k))
    layer.bias.data.copy_(torch.randn(48))
    method.process_weights_after_loading(layer)
    return layer


@bf16_kernel
@pytest.mark.parametrize("amx_rows", [0, pytest.param(24, marks=amx_kernel)])  # without AMX; AMX up to 24 rows
def test_linear_sends_small_batches_to_the_kernel_then_the_amx_tiles(monkeypatch, amx_rows):
    monkeypatch.setattr(small_batch_gemm, "AMX_ROWS", amx_rows)
    monkeypatch.setitem(small_batch_gemm.MAX_ROWS, torch.bfloat16, 8)
    layers = {64: packed_linear(64), 48: packed_linear(48)}  # K = 48: not a tile's depth, never to the tiles
    calls = []
    for name in ("linear", "amx_linear"):
        real = getattr(small_batch_gemm, name)
        monkeypatch.setattr(small_batch_gemm, name,
                            lambda *a, real=real, name=name: calls.append((name, a[0].shape)) or real(*a))
    for k, layer in layers.items():
        for m in (1, 8, 9, 24, 25):
            x = torch.randn(m, k).to(torch.bfloat16)
            # the packed weight, through the kernel at any size
            want = small_batch_gemm.vector_linear(x, layer.small_batch_weight, layer.bias)
            assert torch.allclose(layer(x).float(), want.float(), rtol=2e-2, atol=5e-2)
        assert layer.weight is None and layer.packed is not None  # one copy of the weight: oneDNN's
    vector = [("linear", (m, k)) for k in (64, 48) for m in (1, 8)]
    amx = [("linear", (9, 64)), ("amx_linear", (9, 64)), ("linear", (24, 64)), ("amx_linear", (24, 64))]
    assert calls == (vector[:2] + amx + vector[2:] if amx_rows else vector)  # beyond: oneDNN


@KERNEL_DTYPES
@pytest.mark.parametrize("tie", [False, True])
def test_model_keeps_one_copy_of_each_weight(tiny_model_factory, dtype, tie):
    """Every linear layer keeps oneDNN's packed copy alone, and a tied embedding looks its tokens up in the
    lm_head's, its own table freed: the same rows, bit for bit."""
    from safetensors.torch import load_file

    from folio.loader.model_loader import load_model

    folder = tiny_model_factory("llama", tie)
    net = load_model(folder, dtype, None).model
    for m in net.modules():
        if isinstance(m, Linear):
            assert m.packed is not None and isinstance(m.small_batch_weight, small_batch_gemm.PackedWeight)
            assert m.weight is None
    assert (net.embed_tokens.weight is None) == tie
    table = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"].to(dtype)
    ids = torch.tensor([[0, 5, table.shape[0] - 1], [17, 17, 3]])
    assert torch.equal(net.embed_tokens(ids), table[ids])


@f32_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 13, 16, 31, 62, 64])
@pytest.mark.parametrize("n,k", [(1, 64), (3, 7), (5, 96), (37, 100), (1000, 576), (9, 4864), (130, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_the_exact_product(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = small_batch_gemm.linear(x, packed(w), b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 FMAs in another order than MKL's: the error of a float32 dot product of k terms, no more
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    assert bool(((got.double() - exact).abs() <= bound).all())


@f32_kernel
def test_float32_strided_rows_and_errors():
    x = torch.randn(3, 200)[:, :100]  # row stride 200
    w = packed(torch.randn(8, 100))
    assert torch.equal(small_batch_gemm.linear(x, w, None), small_batch_gemm.linear(x.contiguous(), w, None))
    with pytest.raises(RuntimeError, match="M <= MAX_M_F32"):
        small_batch_gemm.linear(torch.randn(small_batch_gemm.MAX_ROWS[torch.float32] + 1, 100), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        small_batch_gemm.KERNEL.load().linear_f32(x[:, :50], w.blocks[:, ::2], 8, None)
    with pytest.raises(RuntimeError, match="within the blocks' K"):
        small_batch_gemm.linear(torch.randn(2, 2000), w, None)


@f32_kernel
def test_float32_layers_keep_the_packed_weight_and_send_up_to_max_rows_to_the_kernel(monkeypatch):
    layer = Linear(100, 48, bias=True, params_dtype=torch.float32)
    method = DenseLinearMethod()
    layer.bind(method)
    weight = torch.randn(48, 100)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(torch.randn(48))
    method.process_weights_after_loading(layer)
    if layer.small_batch_weight is None:
        pytest.skip("oneDNN packs float32 weights here in a layout the kernel does not read")
    assert layer.weight is None and layer.packed is not None  # one copy: oneDNN's, which the kernel reads
    calls = []
    real = small_batch_gemm.linear
    monkeypatch.setattr(small_batch_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    limit = small_batch_gemm.MAX_ROWS[torch.float32]
    for m in (1, limit, limit + 1, 300):
        x = torch.randn(m, 100)
        assert torch.allclose(layer(x), x @ weight.T + layer.bias, rtol=1e-5, atol=1e-4)
    assert calls == [1, limit]  # more rows go to oneDNN's GEMM


@KERNEL_DTYPES
@pytest.mark.parametrize("n,k", [(1000, 576), (37, 100), (130, 30), (5, 64)])
def test_weight_rows_are_the_packed_weights_rows(dtype, n, k):
    """Any row of a packed weight, K padded or not, the last block's columns partly padding."""
    w = torch.randn(n, k).to(dtype)
    weight = packed(w)
    ids = torch.tensor([[n - 1, 0, n // 2], [1 % n, n - 1, 3 % n]])
    rows = small_batch_gemm.weight_rows(weight, ids)
    assert rows.is_contiguous() and torch.equal(rows, w[ids])


def test_float32_layers_stay_plain_where_the_kernel_cannot_read_the_packed_weight(monkeypatch):
    monkeypatch.setattr(small_batch_gemm, "packed_blocks", lambda packed, weight: None)
    layer = Linear(100, 48, bias=False, params_dtype=torch.float32)
    method = DenseLinearMethod()
    layer.bind(method)
    weight = torch.randn(48, 100)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)
    assert layer.packed is None and layer.small_batch_weight is None and torch.equal(layer.weight, weight)
    x = torch.randn(3, 100)
    assert torch.allclose(layer(x), x @ weight.T, rtol=1e-5, atol=1e-4)


@amx_kernel
@pytest.mark.parametrize("m", [9, 17, 62, 64])
@pytest.mark.parametrize("n,k", [(1000, 576), (37, 64), (5003, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_argmax_is_the_argmax_of_the_written_product(m, n, k, with_bias):
    """The tile loop's argmax epilogue ranks the bf16 values amx_linear writes as torch.argmax does: the first
    of equal maxima (tied columns, a zero row), the first NaN (a NaN row), column 0 of a row of -inf."""
    w = torch.randn(n, k).to(torch.bfloat16)
    if n > 100:
        w[n // 2] = w[n // 3]  # two columns equal in every row: the earlier one is the argmax where they lead
        w[n - 1] = w[n // 3]  # and one in the last, partly filled block
    weight = packed(w)
    x = torch.randn(m, k).to(torch.bfloat16)
    x[1] = 0  # every column 0 (or its bias)
    x[2, 5] = float("nan")  # every column NaN
    x[3] = x[3] * 50  # large sums: ties after rounding to bf16 are likelier
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    y = small_batch_gemm.amx_linear(x, weight, bias)
    assert torch.equal(small_batch_gemm.linear_argmax(x, weight, bias), torch.argmax(y, dim=-1))
    if n > 100:  # a row led by the tied columns
        x[4] = w[n // 3] * 4
        y = small_batch_gemm.amx_linear(x, weight, bias)
        assert torch.equal(small_batch_gemm.linear_argmax(x, weight, bias), torch.argmax(y, dim=-1))
        assert with_bias or int(torch.argmax(y[4])) == n // 3  # the first of the three tied columns
    w[n // 2:, 0], w[n // 2:, 1] = float("inf"), float("-inf")  # NaN columns (inf - inf): the first one leads
    x = torch.randn(m, k).to(torch.bfloat16)
    x[:, :2] = 1
    y = small_batch_gemm.amx_linear(x, packed(w), bias)
    assert torch.equal(small_batch_gemm.linear_argmax(x, packed(w), bias), torch.argmax(y, dim=-1))
    assert small_batch_gemm.linear_argmax(x, packed(w), bias).tolist() == [n // 2] * m
    ninf = torch.full((n,), float("-inf")).to(torch.bfloat16)
    assert small_batch_gemm.linear_argmax(torch.zeros(m, k).to(torch.bfloat16), weight, ninf).tolist() == [0] * m


@bf16_kernel
def test_linear_argmax_leaves_other_batches_to_the_caller():
    """Batches of the vector kernel's size, and plain weights, get None: the caller takes apply's argmax."""
    weight = packed(torch.randn(40, 64).to(torch.bfloat16))
    assert small_batch_gemm.linear_argmax(torch.randn(8, 64).to(torch.bfloat16), weight, None) is None
    assert small_batch_gemm.linear_argmax(torch.randn(20, 64), torch.randn(40, 64), None) is None


@amx_kernel
@pytest.mark.parametrize("m", [9, 16, 17, 40, 62, 64, 100])
@pytest.mark.parametrize("i,k", [(64, 64), (192, 96), (4864, 896)])
def test_amx_silu_epilogue_is_silu_and_mul_of_the_written_product(m, i, k):
    """A gated weight (gated_layout) on the tiles: SiLU-and-mul's bits of the product amx_linear writes for the
    plain weight, at every group count (one, two, panels of three or four, and the gemm past 64 rows), with
    gates that overflow exp, infinite and NaN ones, a zero row (-0.0 sums) and the epilogue's lookups covering
    the other signs and magnitudes."""
    table = fused_ops.bf16_silu_table()
    if table is None:
        pytest.skip("bf16 silu_and_mul uses no table here")
    w = (torch.randn(2 * i, k) * 0.1).to(torch.bfloat16)
    x = (torch.randn(m, k) * 4).to(torch.bfloat16)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0], w[:i // 2, 0] = 1e30, 1e8  # huge gates and ups: exp overflows, products are infinite
    x[4] = -x[4] * 30
    want = fused_ops.silu_and_mul(small_batch_gemm.amx_linear(x, packed(w), None))
    gated = packed(gated_layout.interleave_gated(w))
    got = small_batch_gemm.KERNEL.load().linear_bf16_amx(x, gated.blocks, gated.out_features, None, table)
    assert got.shape == (m, i) and torch.equal(got.view(torch.int16), want.view(torch.int16))
    if m <= small_batch_gemm.AMX_ROWS:
        assert torch.equal(small_batch_gemm.linear_silu_and_mul(x, gated, table).view(torch.int16),
                           want.view(torch.int16))


@bf16_kernel
def test_linear_silu_and_mul_leaves_other_batches_to_the_caller():
    """The vector kernel's batches and oneDNN's (past AMX_ROWS; every batch without AMX) get None: the caller
    takes the op over the product."""
    table = fused_ops.bf16_silu_table()
    weight = packed(gated_layout.interleave_gated(torch.randn(128, 64).to(torch.bfloat16)))
    for rows in (1, small_batch_gemm.MAX_ROWS[torch.bfloat16], small_batch_gemm.AMX_ROWS + 1, 200):
        if small_batch_gemm.MAX_ROWS[torch.bfloat16] < rows <= small_batch_gemm.AMX_ROWS:
            continue
        assert small_batch_gemm.linear_silu_and_mul(torch.randn(rows, 64).to(torch.bfloat16), weight, table) is None


@amx_kernel
def test_amx_silu_epilogue_refuses_what_it_cannot_pair():
    table = fused_ops.bf16_silu_table()
    ext = small_batch_gemm.KERNEL.load()
    x = torch.randn(16, 64).to(torch.bfloat16)
    odd = packed(torch.randn(96, 64).to(torch.bfloat16))  # three blocks of 32: no whole pairs
    with pytest.raises(RuntimeError, match="whole pairs"):
        ext.linear_bf16_amx(x, odd.blocks, odd.out_features, None, table)
    even = packed(torch.randn(128, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="no bias"):
        ext.linear_bf16_amx(x, even.blocks, even.out_features, torch.zeros(128).to(torch.bfloat16), table)
    with pytest.raises(RuntimeError, match="silu table"):
        ext.linear_bf16_amx(x, even.blocks, even.out_features, None, torch.zeros(5, dtype=torch.int32))
