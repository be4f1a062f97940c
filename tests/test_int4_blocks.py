"""int4 weights in column blocks (folio.models.int4_blocks): the packing, the kernels (bf16 x on AVX512-BF16,
float32 x on AVX2) and the dequantisers against the torch reference, on the shapes of the supported models and
odd ones, and the int4 linear method's use of them. Each test runs for the activation dtypes whose kernel is
compiled in here (the float32 one wherever AVX2 is, AVX-512 machines included).

Tolerances: the dequantiser computes q * scale + offset by one float32 FMA and rounds once to bf16 (or not at all),
so it equals the float64 product rounded to float32 (and then to bf16), exactly. The bf16 kernel multiplies bf16 x
by the codes as 1 + q / 16 (exact products) and sums in float32; the float32 one rounds each row of x to 16-bit
codes as quant_reference.quantize_rows_int16 does (bit for bit: tested) and sums the integer products exactly,
then scales them in float32 (quant_reference.w4_int16_linear is its reference); the bf16 one rounds to bf16: each
result lies within one rounding to the output dtype of the float64 reference plus RTOL of the sum of the
magnitudes it adds up."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.models import int4_blocks, onednn_layout, packed_scratch, rescored_head
from folio.models import quant_reference as ref
from folio.models.int4_linear import Int4LinearMethod
from folio.models.linear import Linear
from folio.platforms.cpu_features import has_avx512
from int16_rows import assert_batch_invariant, hard_rows
from int4_weights import int4_rows

_EXT = int4_blocks.KERNEL.load()
HAS_KERNEL = {torch.bfloat16: _EXT is not None and _EXT.has_kernel(),
              torch.float32: _EXT is not None and _EXT.has_f32_kernel()}
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not HAS_KERNEL[dtype], reason=reason), id=str(dtype)[6:])
          for dtype, reason in ((torch.bfloat16, "the bf16 block kernel needs AVX512-BF16 and a working compiler"),
                                (torch.float32, "the float32 block kernel needs AVX2, FMA, F16C and a compiler"))]
needs_bf16 = pytest.mark.skipif(not HAS_KERNEL[torch.bfloat16], reason="needs the AVX512-BF16 block kernel")

RTOL = 2 ** -18
# (N, K, group) of SmolLM2-135M's and Qwen2-0.5B's int4 layers (qkv, o, gate_up, down), groups of 128, and odd
# ones: a block's worth of columns or fewer, N not a multiple of 16 or 64, K of one group
SHAPES = [(960, 576, 32), (576, 576, 32), (3072, 576, 32), (576, 1536, 32), (1152, 896, 32), (896, 896, 32),
          (9728, 896, 32), (896, 4864, 32), (896, 4864, 128), (1, 32, 32), (7, 96, 32), (33, 160, 32),
          (101, 224, 32), (130, 256, 128)]
ROWS = [1, 2, 3, 4, 5, 7, 64, 100]


def _weight(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return ref.quantize_int4(torch.randn(n, k, generator=g) * 0.05, group)


def _fma(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale + offset with one rounding to float32, then to dtype."""
    q = ref.unpack_int4(packed).double()
    group = q.shape[1] // scales.shape[1]
    exact = q * scales.double().repeat_interleave(group, 1) + offsets.double().repeat_interleave(group, 1)
    return exact.float().to(dtype)


@needs_bf16
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_dequantize_is_one_fma_rounded_to_bf16(n, k, group):
    packed, scales, offsets = _weight(n, k, group, seed=n + k)
    weight = int4_blocks.dequantize(int4_blocks.pack(packed, scales, offsets))
    assert weight.shape == (n, k) and weight.dtype == torch.bfloat16
    assert torch.equal(weight, _fma(packed, scales, offsets, torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_float32_blocks_read_back_to_the_row_major_weight(n, k, group, dtype):
    """The float32 blocks keep the weight exactly (the tests' reading back, tests/int4_weights.py, checked)."""
    weight = _weight(n, k, group, seed=n + k)
    for got, want in zip(int4_rows(int4_blocks.pack(*weight, dtype)), weight):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_linear_matches_the_reference(n, k, group, dtype):
    packed, scales, offsets = _weight(n, k, group, seed=3 * n + k)
    blocks = int4_blocks.pack(packed, scales, offsets, dtype)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(max(ROWS), k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    w = ref.dequantize(packed, scales, offsets).double()
    s16 = (scales * 16).double().repeat_interleave(group, 1)
    magnitude = x.double().abs() @ (s16 + w.abs() + offsets.double().abs().repeat_interleave(group, 1)).T
    rounding = 2 ** -8 if dtype == torch.bfloat16 else 0
    for b in (None, bias):
        if dtype == torch.float32:  # x's rows as 16-bit codes first, as the kernel rounds them
            want = ref.w4_int16_linear(x.double(), packed, scales, offsets, b)
        else:
            want = x.double() @ w.T + (0 if b is None else b.double())
        bound = rounding * want.abs() + RTOL * magnitude + 1e-6
        for m in ROWS:
            got = int4_blocks.linear(x[:m], blocks, b)
            assert got.dtype == dtype and got.shape == (m, n)
            assert bool(((got.double() - want[:m]).abs() <= bound[:m]).all()), (m, b is None)


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_float32_rows_are_rounded_to_the_references_16_bit_codes(dtype):
    """A weight of 15 on its diagonal (scale 1, offset 0) gives y[m, n] = s_x 15 q_x[m, n] with one float32
    rounding of an exact product, so the kernel's codes of x show: they are quantize_rows_int16's, ties (a row
    whose scale is 1, halves in it) rounded half to even, zero rows and outliers included."""
    k = 96
    q = torch.zeros(k, k, dtype=torch.uint8)
    q.diagonal().fill_(15)
    packed, scales, offsets = ref.pack_int4(q), torch.ones(k, k // 32), torch.zeros(k, k // 32)
    blocks = int4_blocks.pack(packed, scales, offsets, dtype)
    x = hard_rows(k)
    codes, sx = ref.quantize_rows_int16(x)
    want = (codes.double() * 15 * sx.double()[:, None]).float()
    for m in (1, 2, 3, 6):
        assert torch.equal(int4_blocks.linear(x[:m], blocks, None), want[:m]), m
    assert torch.equal(want, ref.w4_int16_linear(x.double(), packed, scales, offsets, None).float())


@needs_bf16
@pytest.mark.parametrize("n,k,group", [(9728, 896, 32), (896, 4864, 128), (1, 32, 32), (33, 160, 32),
                                     (101, 224, 32)])
def test_dense_linear_is_onednns_gemm_on_the_dequantised_weight(n, k, group, monkeypatch):
    """The weight dequantised into the packed scratch is the one `dequantize` gives, so the GEMM equals oneDNN's on
    that weight packed by oneDNN itself, bit for bit; without a scratch, F.linear on the dequantised weight."""
    packed, scales, offsets = _weight(n, k, group, seed=n * k)
    blocks = int4_blocks.pack(packed, scales, offsets)
    weight = int4_blocks.dequantize(blocks)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(70, k, generator=g).bfloat16()
    for bias in (None, torch.randn(n, generator=g)):
        b = None if bias is None else bias.bfloat16()
        y = int4_blocks.dense_linear(x, blocks, bias)
        scratch = packed_scratch.for_shape(n, k)
        if scratch is not None:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
            assert torch.equal(scratch.blocks, onednn_layout.vnni_blocks(onednn, weight, 2))
            assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], ""))
        want = x.double() @ weight.double().T + (0 if bias is None else b.double())
        assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(packed_scratch, "for_shape", lambda n, k: None)
    assert torch.equal(int4_blocks.dense_linear(x, blocks, None), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("n,k,group", [(960, 576, 32), (576, 1536, 32), (33, 160, 32), (130, 256, 128)])
def test_a_float32_row_gives_the_same_bits_in_every_batch(n, k, group, dtype):
    """From 3 rows the float32 kernel decodes the blocks into tiles once per panel of rows; its sums are the row
    loops' in the same order, so a request's results do not depend on its batch."""
    blocks = int4_blocks.pack(*_weight(n, k, group, seed=k), dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert_batch_invariant(lambda x: int4_blocks.linear(x, blocks, bias), k)


@needs_bf16
def test_two_threads_share_a_scratch_one_call_at_a_time():
    """Two layers of one shape, each multiplied on its own thread: the scratch's lock keeps one's weight from being
    overwritten by the other's mid-call, so each thread's results are its own layer's, every time."""
    import threading

    layers = [int4_blocks.pack(*_weight(640, 256, 32, seed=s)) for s in (1, 2)]
    x = torch.randn(80, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = [int4_blocks.dense_linear(x, blocks, None) for blocks in layers]
    assert not torch.equal(want[0], want[1])
    wrong = []

    def run(i: int) -> None:
        for _ in range(30):
            if not torch.equal(int4_blocks.dense_linear(x, layers[i], None), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_padding_and_errors(dtype):
    packed, scales, offsets = _weight(70, 64, 32, seed=1)
    blocks = int4_blocks.pack(packed, scales, offsets, dtype)
    assert blocks.codes.shape == (2, 32, 64) and blocks.scales.shape == (2, 2, 64) and blocks.dtype == dtype
    words = blocks.codes[1].view(32, 32, 2)  # block 1: columns 64 .. 69 real, 70 .. 127 padding
    assert not bool((words[:, 12:, 0].any() or (words[..., 0] >> 4).any() or words[..., 1].any()))
    assert not bool(blocks.scales[1, :, 6:].any() or blocks.offsets[1, :, 6:].any())
    x = torch.randn(3, 128).to(dtype)[:, ::2]  # rows of a larger tensor
    assert torch.equal(int4_blocks.linear(x, blocks, None), int4_blocks.linear(x.contiguous(), blocks, None))
    ext = int4_blocks.KERNEL.load()
    with pytest.raises(RuntimeError, match=r"x must be bf16 or float32 \[M, 64\]"):
        int4_blocks.linear(torch.randn(1, 64).half(), blocks, None)
    one = torch.randn(1, 64).to(dtype)
    with pytest.raises(RuntimeError, match="N .* must lie within the last block"):
        ext.linear(one, blocks.codes, blocks.scales, blocks.offsets, 140, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        int4_blocks.linear(one, blocks, torch.zeros(70).bfloat16())
    with pytest.raises(RuntimeError, match="scales must be contiguous float16 or float32"):
        ext.linear(one, blocks.codes, blocks.scales.double(), blocks.offsets, 70, None)
    other = torch.float32 if dtype == torch.bfloat16 else torch.float16  # the other kernel's scales
    with pytest.raises(RuntimeError, match="x takes blocks with"):
        ext.linear(one, blocks.codes, blocks.scales.to(other), blocks.offsets.to(other), 70, None)
    # 16 x scale beyond float16: not packed for bf16; float32 keeps it
    assert (int4_blocks.pack(packed, scales * 1e6, offsets, dtype) is None) == (dtype == torch.bfloat16)


def _layer(dtype: torch.dtype, group: int = 32) -> tuple[Linear, torch.Tensor]:
    layer = Linear(256, {"a": 100, "b": 60}, bias=True, params_dtype=dtype)
    method = Int4LinearMethod(group)
    layer.bind(method)
    weight = torch.randn(160, 256) * 0.05
    layer.weight.weight_loader(layer.weight, weight[:100], "a")
    layer.weight.weight_loader(layer.weight, weight[100:], "b")
    layer.bias.data.copy_(torch.randn(160))
    method.process_weights_after_loading(layer)
    return layer, weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_keeps_only_the_blocks_and_routes_by_rows(monkeypatch, dtype):
    """Where the blocks serve the dtype here (float32 ones: on CPUs without AVX-512; forced elsewhere)."""
    monkeypatch.setattr(int4_blocks, "available", lambda d=torch.bfloat16: d == dtype)
    layer, weight = _layer(dtype)
    assert layer.weight is None and layer.weight_scale is None and layer.weight_offset is None
    packed, scales, offsets = ref.quantize_int4(weight, 32)
    assert torch.equal(layer.int4_blocks.codes, int4_blocks.pack(packed, scales, offsets).codes)
    calls = []
    kernel, dense = int4_blocks.linear, int4_blocks.dense_linear
    monkeypatch.setattr(int4_blocks, "linear", lambda *a: calls.append("kernel") or kernel(*a))
    monkeypatch.setattr(int4_blocks, "dense_linear", lambda *a: calls.append("dense") or dense(*a))
    most = int4_blocks.MAX_ROWS if dtype == torch.bfloat16 else 600  # float32: every batch takes the kernel
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 256).to(dtype)
        calls.clear()
        y = layer(x)
        assert calls == (["kernel"] if rows <= most or dtype == torch.float32 else ["dense"])
        if dtype == torch.float32:  # the kernel rounds x to 16-bit codes
            want = ref.w4_int16_linear(x.double(), packed, scales, offsets, layer.bias)
        else:
            want = x.double() @ ref.dequantize(packed, scales, offsets).double().T + layer.bias.double()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert y.dtype == dtype and torch.allclose(y.double(), want, rtol=tol, atol=tol)


def test_float32_blocks_only_without_avx512_and_w4a8_keeps_the_row_major_format():
    assert int4_blocks.available(torch.float32) == (HAS_KERNEL[torch.float32] and not has_avx512())
    assert not int4_blocks.available(torch.float16)
    for dtype, int8_activations in ((torch.float32, False), (torch.bfloat16, True)):
        if int4_blocks.available(dtype) and not int8_activations:
            continue
        layer = Linear(64, 48, params_dtype=dtype)
        method = Int4LinearMethod(int8_activations=int8_activations)
        layer.bind(method)
        layer.weight.weight_loader(layer.weight, torch.randn(48, 64), None)
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and getattr(layer, "int4_blocks", None) is None


@needs_bf16
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False), ("phi3", False)])
def test_a_bf16_model_in_blocks_scores_as_its_float32_twin(tiny_model_factory, monkeypatch, arch, tie):
    """End to end: the same int4 quantisation run in bf16 through the blocks (prompt in one chunk and in chunks
    of 16) and in float32 through the row-major kernels. Measured 0.022-0.026 mean |logprob difference|, as
    much as the unquantised model's bf16 against float32 (0.022-0.028); a wrong kernel is off by whole units.
    Both keep the int8 head (a tied bf16 model's would be the rescored int4 one: tests/test_rescored_head.py)."""
    monkeypatch.setattr(rescored_head, "serves", lambda layer: False)
    folder = tiny_model_factory(arch, tie)
    prompt = [1] + list(range(5, 60))

    def logprobs(dtype: str, **options) -> torch.Tensor:
        llm = LLM(folder, dtype=dtype, quantization="int4", kv_cache_memory=1 << 22, **options)
        blocks = getattr(llm.llm_engine.runner.model.layers[0].mlp.down_proj, "int4_blocks", None)
        assert (blocks is not None) == int4_blocks.available(getattr(torch, dtype))
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        return torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])

    monkeypatch.setattr(int4_blocks, "available", lambda d=torch.bfloat16: d == torch.bfloat16)
    want = logprobs("float32")
    for options in ({}, {"max_num_batched_tokens": 16}):
        assert float((logprobs("bfloat16", **options) - want).abs().mean()) < 0.06, options


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_a_float32_model_in_blocks_scores_as_in_the_row_major_format(tiny_model_factory, monkeypatch, arch, tie,
                                                                     dtype):
    """End to end in float32: the same int4 weights through the float32 block kernel (forced where the CPU has
    AVX-512), which rounds x to 16-bit codes, and through the row-major kernels on float32 x; the prompt's
    logprobs agree to 5e-3 (measured: at most 1.5e-3 and 1.9e-3, 4e-4 and 5e-4 on average; a wrong kernel is
    off by whole units). Both keep the int8 head."""
    monkeypatch.setattr(rescored_head, "serves", lambda layer: False)
    folder = tiny_model_factory(arch, tie)
    prompt = [1] + list(range(5, 60))

    def logprobs(blocks: bool) -> torch.Tensor:
        monkeypatch.setattr(int4_blocks, "available", lambda d=torch.bfloat16: blocks and d == torch.float32)
        llm = LLM(folder, dtype="float32", quantization="int4", kv_cache_memory=1 << 22)
        layer = llm.llm_engine.runner.model.layers[0].mlp.down_proj
        assert (getattr(layer, "int4_blocks", None) is not None) == blocks
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        return torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])

    assert float((logprobs(True) - logprobs(False)).abs().max()) < 5e-3
