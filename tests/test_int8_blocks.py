"""int8 weights in column blocks for float32 x on AVX2 (folio.models.int8_blocks): the packing and the kernel
against the torch reference on the shapes of the supported models and odd ones, and the int8 linear method's
use of them. The kernel is compiled wherever AVX2 is (AVX-512 machines included, where the tests force it in).

Tolerances: the kernel rounds each row of x to 16-bit codes as quant_reference.quantize_rows_int16 does (bit for
bit: tested), sums the integer products exactly in int32 per group (per 256 pairs of a longer one) and scales
and adds those sums in float32; quant_reference.w8_int16_grouped_linear does the same in float64. So each result
lies within RTOL of the sum of the magnitudes it adds up."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.models import int8_blocks, onednn_int8
from folio.models import quant_reference as ref
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear
from folio.platforms.cpu_features import has_avx512
from int16_rows import assert_batch_invariant, hard_rows

_EXT = int8_blocks.KERNEL.load()
pytestmark = pytest.mark.skipif(_EXT is None or not _EXT.has_kernel(),
                                reason="the int8 block kernel needs AVX2, FMA and a working compiler")

RTOL = 2 ** -16
# (N, K, group) of SmolLM2-135M's int8 layers (its lm_head, qkv, gate_up and down, one scale per channel) and of
# GGUF's Q8_0 (groups of 32), and odd ones: a block's worth of columns or fewer, N not a multiple of 8 or 64,
# K of one group, K past the 256 pairs summed in int32 at once (with a remainder)
SHAPES = [(49152, 576, 576), (960, 576, 576), (3072, 576, 32), (576, 1536, 1536), (576, 1536, 32), (1, 32, 32),
          (7, 96, 96), (33, 160, 32), (101, 224, 224), (130, 1024, 1024), (70, 4864, 4864)]
ROWS = [1, 2, 3, 4, 5, 64, 100]


def _weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ref.quantize_int8(torch.randn(n, k, generator=g) * 0.05, group)


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_linear_matches_the_reference(n, k, group):
    q, scales = _weight(n, k, group, seed=n + k)
    blocks = int8_blocks.pack(q, scales)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(max(ROWS), k, generator=g)
    x[2, 5] = 40.0  # an outlier sets its row's scale
    bias = torch.randn(n, generator=g)
    codes, sx = ref.quantize_rows_int16(x)
    magnitude = (codes.double().abs() * sx.double()[:, None]) @ ref.dequantize(q, scales, None).double().abs().T
    for b in (None, bias):
        want = ref.w8_int16_grouped_linear(x.double(), q, scales, b)
        for m in ROWS:
            got = int8_blocks.linear(x[:m], blocks, b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert bool(((got.double() - want[:m]).abs() <= RTOL * magnitude[:m] + 1e-6).all()), (m, b is None)


@pytest.mark.parametrize("n,k,group", [(960, 576, 576), (576, 1536, 32), (101, 224, 224), (70, 1024, 1024)])
def test_a_row_gives_the_same_bits_in_every_batch(n, k, group):
    """From 3 rows the kernel decodes the blocks into tiles once per panel of rows; its sums are the row loops'
    in the same order, so a request's results do not depend on its batch (K past 256 pairs included)."""
    q, scales = _weight(n, k, group, seed=k)
    blocks = int8_blocks.pack(q, scales)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert_batch_invariant(lambda x: int8_blocks.linear(x, blocks, bias), k)


def test_rows_are_rounded_to_the_references_16_bit_codes():
    """A weight of 127 on its diagonal with scale 1 gives y[m, n] = s_x 127 q_x[m, n], one float32 rounding of an
    exact product, so the kernel's codes of x show: quantize_rows_int16's, ties (a row whose scale is 1, halves
    in it) rounded half to even, zero rows and outliers included, each pair of K in its columns."""
    k = 96
    q = torch.zeros(k, k, dtype=torch.int8)
    q.diagonal().fill_(127)
    scales = torch.ones(k, 1)
    blocks = int8_blocks.pack(q, scales)
    x = hard_rows(k)
    codes, sx = ref.quantize_rows_int16(x)
    want = (codes.double() * 127 * sx.double()[:, None]).float()
    for m in (1, 2, 3, 6):
        assert torch.equal(int8_blocks.linear(x[:m], blocks, None), want[:m]), m
    assert torch.equal(want, ref.w8_int16_grouped_linear(x.double(), q, scales, None).float())


def test_the_int32_sums_do_not_overflow_at_the_extremes():
    """Codes of -128 (GGUF's Q8_0 allows them) times x's largest codes over 256 pairs at once: the sum most
    negative a lane holds, 256 * 2 * -128 * 32639 = -2^31 + 8454144. With x's scale 1 every sum is an integer
    that float32 holds, so the result is exact."""
    k = 1024
    q = torch.full((3, k), -128, dtype=torch.int8)
    q[1] = 127
    blocks = int8_blocks.pack(q, torch.ones(3, 1))
    x = torch.full((4, k), float(ref.INT16_CODE_MAX))
    x[1::2, ::4] = -ref.INT16_CODE_MAX
    want = ref.w8_int16_grouped_linear(x.double(), q, torch.ones(3, 1), None).float()
    for m in (2, 4):  # the row loops, the tiles
        assert torch.equal(int8_blocks.linear(x[:m], blocks, None), want[:m]), m


def test_padding_strides_and_errors():
    q, scales = _weight(70, 64, 32, seed=1)
    blocks = int8_blocks.pack(q, scales)
    assert blocks.codes.shape == (2, 32, 128) and blocks.scales.shape == (2, 2, 64)
    assert torch.equal(blocks.codes[0, 3, 2 * 5:2 * 5 + 2], q[5, 6:8])  # column 5, pair 3
    assert not bool(blocks.codes[1, :, 2 * 6:].any() or blocks.scales[1, :, 6:].any())  # columns 70 .. 127
    x = torch.randn(3, 128)[:, ::2]  # rows of a larger tensor
    assert torch.equal(int8_blocks.linear(x, blocks, None), int8_blocks.linear(x.contiguous(), blocks, None))
    one = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        int8_blocks.linear(one.bfloat16(), blocks, None)
    with pytest.raises(RuntimeError, match="N .* must lie within the last block"):
        _EXT.linear(one, blocks.codes, blocks.scales, 140, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        int8_blocks.linear(one, blocks, torch.zeros(70).bfloat16())
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        _EXT.pack(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1))
    assert not int8_blocks.packable(48, torch.ones(4, 1)) and int8_blocks.packable(64, torch.ones(4, 2))


def _layer(method: Int8LinearMethod, dtype: torch.dtype = torch.float32, k: int = 256) -> tuple[Linear, torch.Tensor]:
    layer = Linear(k, {"a": 100, "b": 60}, bias=True, params_dtype=dtype)
    layer.bind(method)
    weight = torch.randn(160, k) * 0.05
    layer.weight.weight_loader(layer.weight, weight[:100], "a")
    layer.weight.weight_loader(layer.weight, weight[100:], "b")
    layer.bias.data.copy_(torch.randn(160))
    method.process_weights_after_loading(layer)
    return layer, weight


def test_a_weight_only_float32_layer_keeps_only_the_blocks(monkeypatch):
    """Where the blocks serve float32 here (CPUs without AVX-512; forced elsewhere); every batch size runs them."""
    monkeypatch.setattr(int8_blocks, "available", lambda dtype: dtype == torch.float32)
    for method in (Int8LinearMethod(), Int8LinearMethod(int16_activations=True, onednn=False)):
        layer, weight = _layer(method)
        assert layer.weight is None and layer.weight_scale is None
        q, scales = ref.quantize_int8(weight, 256)
        assert torch.equal(layer.int8_blocks.codes, int8_blocks.pack(q, scales).codes)
        for rows in (1, 2, 300):
            x = torch.randn(rows, 256)
            want = ref.w8_int16_grouped_linear(x.double(), q, scales, layer.bias)
            assert torch.allclose(layer(x).double(), want, rtol=1e-4, atol=1e-4)


def test_blocks_only_for_weight_only_float32_layers_without_avx512():
    assert int8_blocks.available(torch.float32) == (not has_avx512())
    assert not int8_blocks.available(torch.bfloat16)
    cases = [(Int8LinearMethod(int8_activations=True, rotated=True), torch.float32, 256),  # W8A8
             (Int8LinearMethod(), torch.float32, 80)]  # K not in groups of a multiple of 32
    if not int8_blocks.available(torch.float32):
        cases.append((Int8LinearMethod(), torch.float32, 256))
    for method, dtype, k in cases:
        layer, _ = _layer(method, dtype, k)
        assert layer.int8_blocks is None and (layer.weight is not None or layer.onednn_weight is not None)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_a_float32_model_in_blocks_scores_as_in_the_row_major_format(tiny_model_factory, monkeypatch, arch, tie):
    """End to end in float32 (`w8a16`, all layers and the head int8): through the blocks (forced where the CPU
    has AVX-512), which round x to 16-bit codes, and through the row-major kernel on float32 x; the prompt's
    logprobs agree to 2e-3 (a wrong kernel is off by whole units). oneDNN's int8 path is turned off on both
    sides: on CPUs with VNNI the w8a16 layers would take it before either kernel."""
    folder = tiny_model_factory(arch, tie)
    monkeypatch.setattr(onednn_int8, "usable", lambda: False)
    prompt = [1] + list(range(5, 60))

    def logprobs(blocks: bool) -> torch.Tensor:
        monkeypatch.setattr(int8_blocks, "available", lambda dtype: blocks and dtype == torch.float32)
        llm = LLM(folder, dtype="float32", quantization="w8a16", kv_cache_memory=1 << 22)
        layer = llm.llm_engine.runner.model.layers[0].mlp.down_proj
        assert (layer.int8_blocks is not None) == blocks
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        return torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])

    assert float((logprobs(True) - logprobs(False)).abs().max()) < 2e-3
