"""The rescored int4 lm_head (folio.models.rescored_head): the top-k rescoring kernel against its torch reference,
the head's logits against int4 logits with each row's largest recomputed from the bf16 (or float32) table, and its
choice by the int4 schemes.

Tolerance of a rescored logit: the kernel and the reference sum the same products in float32 in different orders,
then round to the logits' dtype, so each lies within one rounding of the float64 sum plus RTOL of the sum of the
products' magnitudes. Which logits are rescored (the k largest, ties to the lower index) is compared exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from folio import LLM, SamplingParams
from folio.models import int4_blocks, rescored_head
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int4_linear import Int4LinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear
from folio.models.quantization import quantization_chooser
from tests.conftest import hf_logprobs

RTOL = 2 ** -18
needs_kernel = pytest.mark.skipif(rescored_head.KERNEL.load() is None, reason="needs the rescoring kernel built")
_EXT = int4_blocks.KERNEL.load()
# the dtypes whose block kernel is compiled in here (float32's wherever AVX2 is: forced where it is not chosen)
BLOCK_DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not ok, reason="no int4 block kernel for it here"),
                             id=str(dtype)[6:])
                for dtype, ok in ((torch.bfloat16, _EXT is not None and _EXT.has_kernel()),
                                  (torch.float32, _EXT is not None and _EXT.has_f32_kernel()))]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _case(m: int, v: int, h: int, seed: int, ties: bool = False, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    table = (torch.randn(v, h, generator=g) * 0.05).to(dtype)
    x = torch.randn(m, h, generator=g).to(dtype)
    logits = torch.randn(m, v, generator=g)
    if ties:  # few distinct values: the k-th largest is shared by many tokens
        logits = logits.round()
    return logits.to(dtype), x, table


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _check_rescored(got: torch.Tensor, before: torch.Tensor, x: torch.Tensor, table: torch.Tensor, k: int):
    """got = before with each row's k largest (ties to the lower index, NaN lowest) replaced by x . table[t]."""
    key = before.float()
    key = torch.where(key.isnan(), float("-inf"), key)
    top = key.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros_like(before, dtype=torch.bool).scatter_(1, top, True)
    assert got.dtype == before.dtype and torch.equal(_bits(got[~chosen]), _bits(before[~chosen]))
    products = table[top].double() * x.double().unsqueeze(1)  # [M, k, H]
    exact, magnitude = products.sum(-1), products.abs().sum(-1)
    value = got.gather(1, top).double()
    ulp = torch.finfo(got.dtype).eps * exact.abs().clamp_min(torch.finfo(got.dtype).tiny)
    assert bool(((value - exact).abs() <= ulp + RTOL * magnitude).all())


# (M, V, H, k): Qwen2-0.5B's and SmolLM2-135M's heads, H not a multiple of 32 (a masked tail), k >= V, k = 1
CASES = [(1, 151936, 896, 128), (3, 49152, 576, 128), (2, 1000, 100, 16), (4, 37, 7, 64), (5, 300, 33, 1),
         (64, 512, 64, 128)]


@needs_kernel
@pytest.mark.parametrize("m,v,h,k", CASES)
@pytest.mark.parametrize("ties", [False, True])
@DTYPES
def test_kernel_rescores_the_k_largest_of_each_row(m, v, h, k, ties, dtype):
    logits, x, table = _case(m, v, h, seed=m * v + h, ties=ties, dtype=dtype)
    got = rescored_head.rescore_top_k(logits.clone(), x, table, k)
    _check_rescored(got, logits, x, table, min(k, v))


@needs_kernel
@pytest.mark.parametrize("m,v,h,k", CASES)
def test_a_bf16_table_under_float32_logits_gives_the_float32_tables_results_bit_for_bit(m, v, h, k):
    """A float32 model keeps a bf16 checkpoint's table in bf16: its rows are widened exactly as they are read."""
    logits, x, table = _case(m, v, h, seed=m * v + h + 1, dtype=torch.float32)
    narrow = table.to(torch.bfloat16)
    got = rescored_head.rescore_top_k(logits.clone(), x, narrow, k)
    assert torch.equal(_bits(got), _bits(rescored_head.rescore_top_k(logits.clone(), x, narrow.float(), k)))
    _check_rescored(got, logits, x, narrow.float(), min(k, v))


@pytest.mark.parametrize("m,v,h,k", CASES[2:])
def test_reference_rescores_the_k_largest_of_each_row(m, v, h, k):
    logits, x, table = _case(m, v, h, seed=m + v + h, ties=True)
    got = rescored_head.rescore_top_k_reference(logits.clone(), x, table, k)
    _check_rescored(got, logits, x, table, min(k, v))


@needs_kernel
@DTYPES
def test_a_nan_logit_ranks_lowest(dtype):
    logits, x, table = _case(2, 200, 64, seed=5, dtype=dtype)
    logits[0, :10] = float("nan")  # in the heap's seed and in the scan
    logits[1, 150:] = float("nan")
    got = rescored_head.rescore_top_k(logits.clone(), x, table, 20)
    _check_rescored(got, logits, x, table, 20)
    assert got[0, :10].isnan().all() and got[1, 150:].isnan().all()
    # a row of NaN ranks them by index, like a row of -inf: the first k get their exact values
    logits[0] = float("nan")
    got = rescored_head.rescore_top_k(logits.clone(), x, table, 20)
    assert not got[0, :20].isnan().any() and got[0, 20:].isnan().all()


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    logits, x, table = _case(2, 100, 32, seed=1)
    ext = rescored_head.KERNEL.load()
    with pytest.raises(RuntimeError, match="shapes"):
        ext.rescore_top_k(logits, x[:1], table, 4)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        ext.rescore_top_k(logits.float(), x, table, 4)
    with pytest.raises(RuntimeError, match="all of one dtype"):  # a float32 table under bf16 logits
        ext.rescore_top_k(logits, x, table.float(), 4)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        ext.rescore_top_k(logits.half(), x.half(), table.half(), 4)
    with pytest.raises(RuntimeError, match="positive"):
        ext.rescore_top_k(logits, x, table, 0)
    # the Python entry point serves the rest by the reference
    got = rescored_head.rescore_top_k(logits.float(), x, table, 4)
    assert got.dtype == torch.float32


def _tied_head(v: int, h: int, seed: int, method, dtype: torch.dtype = torch.bfloat16) -> tuple[Linear, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    embedding = nn.Parameter((torch.randn(v, h, generator=g) * 0.05).to(dtype), requires_grad=False)
    head = Linear(h, v, tied_to=embedding, params_dtype=dtype)
    head.bind(method)
    method.process_weights_after_loading(head)
    return head, embedding


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 64, 65, 150])  # one chunk, several (rescored_head.CHUNK_ROWS each)
@pytest.mark.parametrize("group", [32, rescored_head.GROUP])
@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_head_is_int4_logits_with_the_largest_exact(rows, group, dtype, monkeypatch):
    monkeypatch.setattr(int4_blocks, "available", lambda d=torch.bfloat16: d == dtype)
    v, h = 1000, 128
    head, embedding = _tied_head(v, h, seed=rows, method=rescored_head.RescoredInt4Head(group, top_k=40), dtype=dtype)
    plain, _ = _tied_head(v, h, seed=rows, method=Int4LinearMethod(group), dtype=dtype)  # the same int4 copy
    assert head.int4_blocks.scales.shape[1] == h // group
    assert head.exact_table.data_ptr() == embedding.data_ptr()  # the embedding's storage, not a copy
    assert head.weight is None and head.int4_blocks is not None  # the head keeps only the int4 blocks
    x = torch.randn(rows, h).to(dtype)
    approx = torch.cat([plain(chunk) for chunk in x.split(rescored_head.CHUNK_ROWS)])
    got = head(x)
    _check_rescored(got, approx, x, embedding.detach(), 40)
    # greedy decoding takes the exact head's choice when it is among the int4 head's 40 largest
    exact = (x.double() @ embedding.double().t()).to(dtype)
    assert torch.equal(got.float().argmax(-1), exact.float().argmax(-1))


def test_head_needs_a_tied_layer_without_bias():
    method = rescored_head.RescoredInt4Head(32)
    with pytest.raises(ValueError, match="tied layer without bias"):
        Linear(64, 100, params_dtype=torch.bfloat16).bind(method)


def test_int4_schemes_rescore_a_tied_head_of_block_layers_only():
    dense = DenseLinearMethod()
    embedding = nn.Parameter(torch.zeros(100, 64, dtype=torch.bfloat16), requires_grad=False)
    tied = Linear(64, 100, tied_to=embedding, params_dtype=torch.bfloat16)
    untied = Linear(64, 100, params_dtype=torch.bfloat16)
    tied_float = Linear(64, 100, tied_to=nn.Parameter(torch.zeros(100, 64)), params_dtype=torch.float32)
    for scheme, group in (("int4", 64), ("int4-g128", 128)):
        choose = quantization_chooser(scheme, dense)
        if int4_blocks.available() and rescored_head.KERNEL.load() is not None:
            assert isinstance(choose("lm_head", tied), rescored_head.RescoredInt4Head)
            assert choose("lm_head", tied).preferred_group_size == group
        else:
            assert isinstance(choose("lm_head", tied), Int8LinearMethod)
        assert isinstance(choose("lm_head", untied), Int8LinearMethod)  # no exact table without a copy
        float_blocks = int4_blocks.available(torch.float32) and rescored_head.KERNEL.load() is not None
        assert isinstance(choose("lm_head", tied_float),
                          rescored_head.RescoredInt4Head if float_blocks else Int8LinearMethod)
    for scheme in ("int8", "w8a16", "w4a8"):
        assert isinstance(quantization_chooser(scheme, dense)("lm_head", tied), Int8LinearMethod)


@needs_kernel
@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_a_tied_int4_model_rescores_its_head_from_its_table(tiny_model_factory, monkeypatch, dtype):
    """bf16 on AVX512-BF16; float32 where its int4 layers are blocks (AVX2 without AVX-512; forced elsewhere): the
    tied head is rescored from the embedding in the model's dtype. Measured 0.54 in bf16; int4 with the int8
    head: 0.53 in float32 (test_quantization.MEAN_LOGPROB_ERROR)."""
    monkeypatch.setattr(int4_blocks, "available", lambda d=torch.bfloat16: d == dtype)
    folder = tiny_model_factory("llama", True)
    llm = LLM(folder, dtype=str(dtype)[6:], quantization="int4", kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    assert isinstance(model.lm_head.method, rescored_head.RescoredInt4Head)
    assert model.lm_head.exact_table.data_ptr() == model.embed_tokens.weight.data_ptr()
    prompt = [1] + list(range(5, 60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
    want = hf_logprobs(folder, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert float((got - want).abs().mean()) < 0.9
