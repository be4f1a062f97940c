"""Attention sinks (GPT-OSS: a logit per query head that joins every softmax's denominator and weighs no value) in
every attention backend and path, against the float64 reference of test_sliding_window (its plain_attention adds
the sinks as one more column of scores whose probability is dropped).

Paths: the reference backend (SDPA has no sinks: Transformers' eager softmax), the paged kernel's loops (scalar for
head_dim 40, the vector one this CPU compiles for the others, the grouped-query bf16 decode on AVX512-BF16 / AMX for
groups of 4 and 8), a context split across threads (the sink counts once in the merge of the partitions), 8-bit
caches, and the long-query paths: PyTorch's flash attention declines sinks (float32 caches' long queries stay on the
kernel), flash_prefill's tiles take them (float32 products; bf16 products where the CPU has AVX512-BF16), and the
kernel's own loops take them where no path is given (long_queries={}). Sinks are drawn from well below the scores
to well above them: ignoring them would move half the outputs far past the tolerances (checked).
"""

from __future__ import annotations

import pytest
import torch

from folio.attention import cpu_paged, sdpa_prefill
from folio.attention.backend import AttentionParams
from folio.attention.kv_quant import KV_QUANTIZATIONS
from folio.attention.torch_sdpa import TorchSDPABackend
from test_cpu_paged_attention import make_step, paged, run  # noqa: F401 (fixture)
from test_flash_prefill import attend_all, check_close, flash_kernel, needs_products, reference  # noqa: F401
from test_sliding_window import MIXED, backend, check, expected  # noqa: F401 (fixture)
from test_sliding_window import make_step as make_windowed_step


def sinks(heads: int, seed: int) -> torch.Tensor:
    """Per head, a sink from well below the scores (it barely counts) to well above (it takes most of the mass)."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3 + 1).float()


def test_sinks_matter():
    # the reference's outputs with and without sinks: what a backend that ignored them would be off by
    step = make_windowed_step(MIXED, 8, 2, 2, 64, torch.float32, None, seed=1)
    with_sinks = expected(step, AttentionParams(sinks=sinks(4, 0)))
    without = expected(step, AttentionParams())
    assert ((with_sinks - without).abs().amax(-1) > 1e-2).float().mean() > 0.4


@pytest.mark.parametrize("softcap,window", [(None, None), (30.0, 8)])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 2, 8), (40, 4, 8), (128, 1, 16), (64, 4, 16),
                                                       (128, 8, 32)])
def test_sinks_in_every_backend(backend, softcap, window, head_dim, group, block_size):
    # decodes, whole prompts and chunks after context; long ones go to the CPU's long-query path of each cache dtype
    params = AttentionParams(sliding_window=window, logit_softcap=softcap, sinks=sinks(2 * group, head_dim + group))
    for dtype in (torch.float32, torch.bfloat16):
        step = make_windowed_step(MIXED, block_size, 2, group, head_dim, dtype, window, seed=head_dim + block_size)
        check(backend, step, params, dtype)


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4)])
def test_sinks_in_the_kernels_own_long_queries(paged, head_dim, group):
    # the long queries the default backend sends to a matrix-product path, on the paged kernel's loops instead
    kernel_only = cpu_paged.CPUPagedAttentionBackend(long_queries={})
    params = AttentionParams(sliding_window=37, sinks=sinks(2 * group, 7))
    for dtype in (torch.float32, torch.bfloat16):
        check(kernel_only, make_windowed_step(MIXED, 16, 2, group, head_dim, dtype, 37, seed=head_dim), params, dtype)


def test_pytorch_flash_attention_declines_sinks():
    path = sdpa_prefill.SdpaPrefill(*sdpa_prefill.FLOAT32_WITHOUT_AVX512)
    q = torch.zeros(1, 4, 64)
    assert path.supports(AttentionParams(), q) and not path.supports(AttentionParams(sinks=sinks(4, 0)), q)


def test_sinks_count_once_when_the_context_is_split_across_threads(paged):
    splitting = cpu_paged.CPUPagedAttentionBackend(min_split_keys=16, min_parallel_work=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for specs in ([(1, 1000)], [(1, 333), (1, 17)], [(9, 100)]):
            for window in (None, 64):
                for dtype in (torch.float32, torch.bfloat16):
                    step = make_windowed_step(specs, 16, 2, 7, 64, dtype, window, seed=len(specs))
                    check(splitting, step, AttentionParams(sliding_window=window, sinks=sinks(14, 3)), dtype)
    finally:
        torch.set_num_threads(threads)


def attend(backend, q, k, v, cache, layout, params: AttentionParams) -> torch.Tensor:
    cache = (cache[0].clone(), cache[1].clone())
    with torch.inference_mode():
        return backend.forward(q, k, v, cache, backend.build_metadata(layout), params)


@pytest.mark.parametrize("name", list(KV_QUANTIZATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_with_8bit_caches(paged, name, dtype):
    # against float32 attention on the same codes (the reference backend's, with float32 q), within the bounds of
    # test_kv_cache_8bit (bf16: the probabilities' rounding, 2^-9 of the largest |v|); the long queries go to this
    # CPU's path for 8-bit caches
    quant = KV_QUANTIZATIONS[name]
    params = AttentionParams(sliding_window=37, sinks=sinks(8, 5))
    q, k, v, cache, layout = make_step(MIXED, 16, 2, 4, 64, dtype, seed=11)
    cache = tuple(quant.quantize(c) for c in cache)
    out = attend(cpu_paged.CPUPagedAttentionBackend(), q, k, v, cache, layout, params)
    exact = attend(TorchSDPABackend(), q.float(), k.float(), v.float(), cache, layout, params)
    v_max = max(quant.dequantize(cache[1], torch.float32).abs().max().item(), v.float().abs().max().item())
    tol, rounded_p = (2e-5, 0.0) if dtype == torch.float32 else (2 ** -8, v_max * 2 ** -9)
    assert bool(((out.float() - exact).abs() <= exact.abs() * tol + v_max * 1e-5 + rounded_p).all())


@pytest.mark.parametrize("bf16_products", [False, True], ids=["fp32-products", "bf16-products"])
@pytest.mark.parametrize("window", [None, 40])
def test_sinks_in_flash_prefill(flash_kernel, bf16_products, window):
    needs_products(bf16_products)
    params = AttentionParams(sliding_window=window, sinks=sinks(14, 9))
    specs = [(300, 300), (37, 1000), (64, 200), (3, 500)]
    q, k, v, cache, layout = make_windowed_step(specs, 16, 2, 7, 64, torch.bfloat16, window, seed=7)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, params, bf16_products)
    check_close(out, reference(q, written, layout, params), torch.nan_to_num(written[1]), bf16_products)


def test_sinks_are_a_float32_vector():
    with pytest.raises(ValueError, match="sinks must be a float32 vector"):
        AttentionParams(sinks=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sinks must be a float32 vector"):
        AttentionParams(sinks=torch.zeros(2, 2))
