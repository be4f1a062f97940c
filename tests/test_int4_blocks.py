"""int4 weights in column blocks (folio.models.int4_blocks): the packing, the kernel and the dequantiser against
the torch reference, on the shapes of the supported models and odd ones, and the int4 linear method's use of them.

Tolerances: the dequantiser computes q * scale + offset by one float32 FMA and rounds once to bf16, so it equals
the float64 product rounded to float32 and then to bf16, exactly. The kernel multiplies bf16 x by the codes as
1 + q / 16 (exact products) and sums in float32 in its own order, then rounds to bf16: each result lies within
one bf16 rounding of the float64 reference plus RTOL of the sum of the magnitudes it adds up."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.models import int4_blocks, onednn_layout, packed_scratch, rescored_head
from folio.models import quant_reference as ref
from folio.models.int4_linear import Int4LinearMethod
from folio.models.linear import Linear

pytestmark = pytest.mark.skipif(not int4_blocks.available(),
                                reason="the int4 block kernel needs AVX512-BF16 and a working compiler")

RTOL = 2 ** -18
# (N, K, group) of SmolLM2-135M's and Qwen2-0.5B's int4 layers (qkv, o, gate_up, down), groups of 128, and odd
# ones: a block's worth of columns or fewer, N not a multiple of 16 or 64, K of one group
SHAPES = [(960, 576, 32), (576, 576, 32), (3072, 576, 32), (576, 1536, 32), (1152, 896, 32), (896, 896, 32),
          (9728, 896, 32), (896, 4864, 32), (896, 4864, 128), (1, 32, 32), (7, 96, 32), (33, 160, 32),
          (101, 224, 32), (130, 256, 128)]
ROWS = [1, 2, 3, 4, 5, 7, 64]


def _weight(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return ref.quantize_int4(torch.randn(n, k, generator=g) * 0.05, group)


def _fma_bf16(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """q * scale + offset with one rounding to float32, then to bf16."""
    q = ref.unpack_int4(packed).double()
    group = q.shape[1] // scales.shape[1]
    exact = q * scales.double().repeat_interleave(group, 1) + offsets.double().repeat_interleave(group, 1)
    return exact.float().bfloat16()


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_dequantize_is_one_fma_rounded_to_bf16(n, k, group):
    packed, scales, offsets = _weight(n, k, group, seed=n + k)
    weight = int4_blocks.dequantize(int4_blocks.pack(packed, scales, offsets))
    assert weight.shape == (n, k) and weight.dtype == torch.bfloat16
    assert torch.equal(weight, _fma_bf16(packed, scales, offsets))


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_linear_matches_the_reference(n, k, group):
    packed, scales, offsets = _weight(n, k, group, seed=3 * n + k)
    blocks = int4_blocks.pack(packed, scales, offsets)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(max(ROWS), k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    w = ref.dequantize(packed, scales, offsets).double()
    s16 = (scales * 16).double().repeat_interleave(group, 1)
    magnitude = x.double().abs() @ (s16 + w.abs() + offsets.double().abs().repeat_interleave(group, 1)).T
    for b in (None, bias):
        want = x.double() @ w.T + (0 if b is None else b.double())
        bound = 2 ** -8 * want.abs() + RTOL * magnitude + 1e-6
        for m in ROWS:
            got = int4_blocks.linear(x[:m], blocks, b)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert bool(((got.double() - want[:m]).abs() <= bound[:m]).all()), (m, b is None)


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


def test_strided_rows_padding_and_errors():
    packed, scales, offsets = _weight(70, 64, 32, seed=1)
    blocks = int4_blocks.pack(packed, scales, offsets)
    assert blocks.codes.shape == (2, 32, 64) and blocks.scales.shape == (2, 2, 64)
    words = blocks.codes[1].view(32, 32, 2)  # block 1: columns 64 .. 69 real, 70 .. 127 padding
    assert not bool((words[:, 12:, 0].any() or (words[..., 0] >> 4).any() or words[..., 1].any()))
    assert not bool(blocks.scales[1, :, 6:].any() or blocks.offsets[1, :, 6:].any())
    x = torch.randn(3, 128).bfloat16()[:, ::2]  # rows of a larger tensor
    assert torch.equal(int4_blocks.linear(x, blocks, None), int4_blocks.linear(x.contiguous(), blocks, None))
    ext = int4_blocks.KERNEL.load()
    with pytest.raises(RuntimeError, match=r"x must be bf16 \[M, 64\]"):
        int4_blocks.linear(torch.randn(1, 64), blocks, None)
    with pytest.raises(RuntimeError, match="N .* must lie within the last block"):
        ext.linear(torch.randn(1, 64).bfloat16(), blocks.codes, blocks.scales, blocks.offsets, 140, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        int4_blocks.linear(torch.randn(1, 64).bfloat16(), blocks, torch.zeros(70).bfloat16())
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        ext.linear(torch.randn(1, 64).bfloat16(), blocks.codes, blocks.scales.float(), blocks.offsets, 70, None)
    assert int4_blocks.pack(packed, scales * 1e6, offsets) is None  # 16 x scale beyond float16: not packed


def _bf16_layer(group: int = 32) -> tuple[Linear, torch.Tensor]:
    layer = Linear(256, {"a": 100, "b": 60}, bias=True, params_dtype=torch.bfloat16)
    method = Int4LinearMethod(group)
    layer.bind(method)
    weight = torch.randn(160, 256) * 0.05
    layer.weight.weight_loader(layer.weight, weight[:100], "a")
    layer.weight.weight_loader(layer.weight, weight[100:], "b")
    layer.bias.data.copy_(torch.randn(160))
    method.process_weights_after_loading(layer)
    return layer, weight


def test_a_bf16_layer_keeps_only_the_blocks_and_routes_by_rows(monkeypatch):
    layer, weight = _bf16_layer()
    assert layer.weight is None and layer.weight_scale is None and layer.weight_offset is None
    packed, scales, offsets = ref.quantize_int4(weight, 32)
    assert torch.equal(layer.int4_blocks.codes, int4_blocks.pack(packed, scales, offsets).codes)
    calls = []
    kernel, dense = int4_blocks.linear, int4_blocks.dense_linear
    monkeypatch.setattr(int4_blocks, "linear", lambda *a: calls.append("kernel") or kernel(*a))
    monkeypatch.setattr(int4_blocks, "dense_linear", lambda *a: calls.append("dense") or dense(*a))
    for rows in (1, int4_blocks.MAX_ROWS, int4_blocks.MAX_ROWS + 1):
        x = torch.randn(rows, 256).bfloat16()
        calls.clear()
        y = layer(x)
        assert calls == (["kernel"] if rows <= int4_blocks.MAX_ROWS else ["dense"])
        want = x.double() @ ref.dequantize(packed, scales, offsets).double().T + layer.bias.double()
        assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), want, rtol=2e-2, atol=2e-2)


def test_float32_layers_and_w4a8_keep_the_row_major_format():
    for dtype, int8_activations in ((torch.float32, False), (torch.bfloat16, True)):
        layer = Linear(64, 48, params_dtype=dtype)
        method = Int4LinearMethod(int8_activations=int8_activations)
        layer.bind(method)
        layer.weight.weight_loader(layer.weight, torch.randn(48, 64), None)
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and getattr(layer, "int4_blocks", None) is None


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
        assert (blocks is not None) == (dtype == "bfloat16")
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        return torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])

    want = logprobs("float32")
    for options in ({}, {"max_num_batched_tokens": 16}):
        assert float((logprobs("bfloat16", **options) - want).abs().mean()) < 0.06, options
