"""The 8-bit KV cache (kv_cache_dtype int8 / fp8): the row format, the paged kernel against the torch
reference (the same bytes written, outputs as close as float32 sums allow), and whole models."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_model, hf_logprobs
from folio import LLM, SamplingParams
from folio.attention import cpu_paged
from folio.attention.backend import AttentionParams
from folio.attention.kv_quant import KV_QUANTIZATIONS, SCALE_BYTES, of_cache
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.config import EngineConfig
from folio.models.model_config import ModelConfig
from folio.worker.kv_cache import KVCacheSpec
from test_cpu_paged_attention import MIXED, make_step, run

FORMATS = list(KV_QUANTIZATIONS)
PROMPT = [1] + list(range(5, 60))
# Mean |logprob - Transformers' float32 logprob| over the prompt (mean |logprob| 7.4) on the tiny random models:
# measured 0.018 (int8) and 0.093 (fp8), the same on both backends; a wrong cache read is off by whole units.
MEAN_LOGPROB_ERROR = {"int8": 0.04, "fp8": 0.2}


@pytest.mark.parametrize("name", FORMATS)
def test_rows_round_to_their_own_scale(name):
    quant = KV_QUANTIZATIONS[name]
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 3, 7)[:, None, None]  # rows of very different sizes
    x[0, 0] = 0
    rows = quant.quantize(x)
    assert rows.shape == (7, 3, 64 + SCALE_BYTES) and rows.dtype == quant.storage_dtype and of_cache(rows) is quant
    scale = x.abs().amax(-1, keepdim=True) / quant.max_code
    err = (quant.dequantize(rows, torch.float32) - x).abs()
    if name == "int8":
        bound = scale / 2 * (1 + 1e-6)
    else:  # e4m3: 3 mantissa bits (half a step is 2^-4 of the value), subnormal steps of 2^-9
        bound = x.abs() * 2 ** -4 + scale * 2 ** -10
    assert bool((err <= bound + 1e-30).all())
    assert float(quant.dequantize(rows, torch.float32)[0, 0].abs().max()) == 0.0


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,group", [(64, 7), (40, 3), (128, 1)])
def test_paged_kernel_writes_the_reference_bytes_and_attends_as_closely_as_its_bf16_path(name, dtype, head_dim,
                                                                                         group):
    if cpu_paged.load_extension() is None:
        pytest.skip(f"no paged attention kernel: {cpu_paged.extension_error()}")
    quant = KV_QUANTIZATIONS[name]
    q, k, v, cache, layout = make_step(MIXED, 16, 2, group, head_dim, dtype, seed=head_dim + group)
    cache = tuple(quant.quantize(c) for c in cache)
    out, new_cache = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    ref, ref_cache = run(TorchSDPABackend(), q, k, v, cache, layout)
    assert torch.equal(new_cache[0], ref_cache[0]) and torch.equal(new_cache[1], ref_cache[1])
    assert out.dtype == dtype
    # against float32 attention on the same codes (the reference dequantises into q's dtype first, so in bf16
    # it is further off): in float32 the kernel dequantises and sums in float32, one rounding to the output
    # (float32 sums in another order: within 1e-5 of the largest |v| the sums run over); with bf16 q and a
    # head_dim of a multiple of 32 it also rounds each probability times its value's scale to bf16, as the
    # bf16 cache's path rounds probabilities (2^-9 of the largest |v| at most)
    exact, _ = run(TorchSDPABackend(), q.float(), k.float(), v.float(), cache, layout)
    v_max = max(quant.dequantize(cache[1], torch.float32).abs().max().item(), v.float().abs().max().item())
    tol = 2e-5 if dtype == torch.float32 else 2 ** -8
    rounded_p = v_max * 2 ** -9 if dtype == torch.bfloat16 and head_dim % 32 == 0 else 0.0
    assert bool(((out.float() - exact).abs() <= exact.abs() * tol + v_max * 1e-5 + rounded_p).all())


def on_code_grid(name: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    """x moved onto the codes of 8-bit rows whose scales are powers of two (2^-4 .. 2^4, at random per row):
    each row's values rounded to int8 codes or fp8 e4m3 values, its largest |value| set to the format's largest
    code, times its scale."""
    quant = KV_QUANTIZATIONS[name]
    x = x / x.abs().amax(-1, keepdim=True) * quant.max_code
    x = x.round() if name == "int8" else x.to(torch.float8_e4m3fn).float()
    scales = 2.0 ** torch.randint(-4, 5, x.shape[:-1] + (1,), generator=torch.Generator().manual_seed(seed))
    return (x * scales).to(torch.bfloat16)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim,group", [(64, 7), (128, 7), (64, 3), (128, 1), (32, 4)])
@pytest.mark.parametrize("params", [AttentionParams(), AttentionParams(sliding_window=9, logit_softcap=30.0)],
                         ids=["full", "window-softcap"])
def test_8bit_cache_attends_as_a_bf16_cache_of_the_same_values(name, head_dim, group, params):
    """Rows whose scales are powers of two hold the same values as a bf16 cache. With bf16 q on AVX512-BF16 the
    kernel takes an 8-bit cache's codes exactly into bf16 and each row's scale into its scores and
    probabilities, which moves no rounding (elsewhere both caches' rows widen to the same float32 values): its
    output (decodes of grouped heads on their own path, the rest on the general one) equals the bf16 cache's
    bit for bit, but where a probability times a scale falls below float's normal range (1.2e-38), which
    vdpbf16ps flushes to zero: a power of two moves which ones do. The kernel attends every query here: the
    long-query paths (folio.attention.long_query) of the two dtypes differ by CPU."""
    if cpu_paged.load_extension() is None:
        pytest.skip(f"no paged attention kernel: {cpu_paged.extension_error()}")
    q, k, v, cache, layout = make_step(MIXED, 16, 2, group, head_dim, torch.bfloat16, seed=head_dim + group)
    k, v = on_code_grid(name, k, 1), on_code_grid(name, v, 2)
    cache = tuple(on_code_grid(name, c.float(), 3 + i) for i, c in enumerate(cache))
    quant = KV_QUANTIZATIONS[name]
    codes = tuple(quant.quantize(c) for c in cache)
    assert bool((quant.dequantize(codes[1], torch.bfloat16) == cache[1]).all())
    assert len(codes[1][..., head_dim:].view(torch.float32).unique()) == 9
    backend = cpu_paged.CPUPagedAttentionBackend(long_queries={})

    def attend(kv):
        with torch.inference_mode():
            return backend.forward(q, k, v, (kv[0].clone(), kv[1].clone()), backend.build_metadata(layout), params)

    out8, out16 = attend(codes), attend(cache)
    assert not bool((out8 != out16).logical_and((out8.float() - out16.float()).abs() > 1e-37).any())


def test_an_8bit_block_takes_about_half_of_bf16_and_a_quarter_of_float32():
    cfg = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100,
                                   "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                   "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 64})
    sizes = {d: KVCacheSpec.for_model(cfg, 16, dtype, d).bytes_per_block(TorchSDPABackend())
             for dtype, d in ((torch.bfloat16, "auto"), (torch.bfloat16, "int8"), (torch.float32, "fp8"))}
    assert sizes["auto"] == 2 * 24 * 16 * 2 * 64 * 2
    assert sizes["int8"] == sizes["fp8"] == 2 * 24 * 16 * 2 * (64 + SCALE_BYTES)  # 68 / 128 of bf16's
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp16")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_models_with_an_8bit_cache_stay_close_to_float_transformers(tiny_model_factory, name, backend):
    folder = tiny_model_factory("qwen2", False)
    budget = 1 << 20
    llm = LLM(folder, dtype="float32", kv_cache_dtype=name, attention_backend=backend, kv_cache_memory=budget)
    float_block = KVCacheSpec.for_model(llm.llm_engine.model_config, 16, torch.float32).bytes_per_block(
        TorchSDPABackend())
    num_blocks = llm.llm_engine.runner.kv_caches[0][0].shape[0]
    assert num_blocks == budget // (float_block * 20 // 64)  # a head's row: 16 codes and a scale, not 16 floats
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
    want = hf_logprobs(folder, PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert float((got - want).abs().mean()) < MEAN_LOGPROB_ERROR[name]


def prompt_logprob_error(folder: str, dtype: str, kv_cache_dtype: str, want: torch.Tensor) -> float:
    llm = LLM(folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
    return float((got - want).abs().mean())


@pytest.mark.parametrize("name", FORMATS)
def test_a_bf16_model_with_an_8bit_cache_adds_only_the_two_roundings(tmp_path, name):
    """A bf16 engine whose heads take the bf16 tile paths from an 8-bit cache (head_dim 32, 4 heads per kv head:
    the grouped decode path and the general one for the prompt) is off float32 Transformers by about the bf16
    model's error plus the float32 model's with the same cache (measured: int8 0.166 against 0.125 + 0.104, fp8
    0.566 against 0.125 + 0.523); a wrong read of the cache is off by whole units."""
    folder = build_tiny_model(str(tmp_path), "qwen2", hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=32)
    want = hf_logprobs(folder, PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    bf16 = prompt_logprob_error(folder, "bfloat16", "auto", want)
    float_8bit = prompt_logprob_error(folder, "float32", name, want)
    assert prompt_logprob_error(folder, "bfloat16", name, want) <= 1.1 * (bf16 + float_8bit)
