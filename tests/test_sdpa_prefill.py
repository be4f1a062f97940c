"""Prefill attention through PyTorch's CPU flash attention (folio.attention.sdpa_prefill) against a float64
reference, on any CPU, in float32 and bf16: whole prompts (one causal call), chunks after context and windows (query
tiles with masks, tiles smaller than the query too), grouped-query heads; through the backend, where decodes and
short chunks stay on the kernel; which path each CPU picks; greedy tokens equal with the path on and off.

Tolerances (the reference is float64 attention on the same inputs): float32 sums over a few hundred keys (2^-16 of
the largest |v|, 2^-20 of the output); in bf16 the probabilities are rounded to bf16 before P.V (2^-9 of the
largest |v|), the output once (2^-8 of its size).
"""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.attention import cpu_paged, flash_prefill, sdpa_prefill
from folio.attention.backend import AttentionParams
from test_cpu_paged_attention import check_against_reference, make_step, paged, run  # noqa: F401 (fixture)
from test_flash_prefill import CHUNKINGS, reference
from test_sliding_window import make_step as make_windowed_step

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
KERNEL_ONLY: dict = {}


def check_close(out, exact, values):
    v_max = values.float().abs().max().item()
    if out.dtype == torch.float32:
        bound = exact.abs() * 2 ** -20 + v_max * 2 ** -16
    else:
        bound = exact.abs() * 2 ** -8 + v_max * 2 ** -9 + 1e-5
    err = (out.double() - exact).abs()
    assert not err.isnan().any()
    assert (err <= bound).all(), (err - bound).max()


def attend_all(q, cache, layout, params):
    """Every request of the layout through the path, from a cache the kernel has written."""
    metadata = cpu_paged.CPUPagedAttentionBackend(long_queries=KERNEL_ONLY).build_metadata(layout)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    sdpa_prefill.SdpaPrefill(1, 1).attend(out, q, cache[0], cache[1], metadata.reqs, metadata.block_tables,
                                          params.scale_for(q.shape[-1]), params)
    return out


def written_step(make, specs, *args, **kwargs):
    q, k, v, cache, layout = make(specs, *args, **kwargs)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries=KERNEL_ONLY), q, k, v, cache, layout)
    return q, written, layout


# (query length, context length): whole prompts (one causal call), chunks after context that ends or starts
# mid-block, a one-token query and a two-token prompt
SPECS = [(300, 300), (37, 1000), (129, 129), (1, 50), (2, 2), (200, 333)]


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_the_reference(paged, dtype, block_size, group, head_dim):
    q, written, layout = written_step(make_step, SPECS, block_size, 2, group, head_dim, dtype,
                                      seed=block_size * 100 + group * 10 + head_dim)
    out = attend_all(q, written, layout, AttentionParams())
    check_close(out, reference(q, written, layout, AttentionParams()), written[1])


@DTYPES
@pytest.mark.parametrize("window", [1, 17, 150])
@pytest.mark.parametrize("tiny_tiles", [False, True], ids=["tiles", "tiny-tiles"])
def test_windows_and_query_tiles(paged, monkeypatch, dtype, window, tiny_tiles):
    # blocks wholly before a request's window hold NaN: reading one makes the output NaN
    if tiny_tiles:  # every tile of MIN_TILE_QUERIES rows: a query spans several
        monkeypatch.setattr(sdpa_prefill, "MASK_ELEMENTS", 1)
    specs = [(300, 300), (37, 1000), (64, 200), (3, 500)]
    q, written, layout = written_step(make_windowed_step, specs, 16, 2, 3, 64, dtype, window, seed=window)
    params = AttentionParams(sliding_window=window)
    check_close(attend_all(q, written, layout, params), reference(q, written, layout, params),
                torch.nan_to_num(written[1]))


def test_chunks_in_tiles_without_a_window(paged, monkeypatch):
    monkeypatch.setattr(sdpa_prefill, "MASK_ELEMENTS", 1)
    q, written, layout = written_step(make_step, [(37, 1000), (100, 140)], 16, 2, 3, 64, torch.float32, seed=9)
    check_close(attend_all(q, written, layout, AttentionParams()),
                reference(q, written, layout, AttentionParams()), written[1])


def test_soft_capped_layers_stay_on_the_kernel():
    path = sdpa_prefill.SdpaPrefill(1, 1)
    assert path.supports(AttentionParams(sliding_window=8), 64)
    assert not path.supports(AttentionParams(logit_softcap=30.0), 64)


@DTYPES
def test_backend_sends_long_queries_there(paged, dtype):
    rule = sdpa_prefill.FLOAT32_WITHOUT_AVX512
    backend = cpu_paged.CPUPagedAttentionBackend(long_queries={dtype: lambda: sdpa_prefill.SdpaPrefill(*rule)})
    long_len = max(rule[0], int(rule[1] ** 0.5) + 1)
    short_chunk = rule[0] - 1
    step = make_step([(long_len + 37, long_len + 37), (1, 50), (long_len, 3 * long_len + 5), (short_chunk, 2000),
                      (1, 9)], 16, 2, 7, 64, dtype, seed=11)
    split = backend.build_metadata(step[-1]).split_for(dtype, backend.long_query_path(dtype))
    assert split.long_reqs[:, 1].tolist() == [long_len + 37, long_len]
    check_against_reference(backend, step, dtype)


def test_each_cpu_picks_its_paths(paged, monkeypatch):
    without_avx512 = cpu_paged.long_query_paths(kernel_has_avx512=False)
    assert isinstance(without_avx512[torch.float32](), sdpa_prefill.SdpaPrefill)
    assert without_avx512[torch.bfloat16] is without_avx512[torch.int8] is without_avx512[torch.uint8] \
        is flash_prefill.if_built
    ext = flash_prefill.KERNEL.load()
    for amx, rules in ((True, (flash_prefill.BF16_PRODUCTS_AMX, flash_prefill.EIGHT_BIT_PRODUCTS_AMX)),
                       (False, (flash_prefill.BF16_PRODUCTS, flash_prefill.EIGHT_BIT_PRODUCTS))):
        monkeypatch.setattr(cpu_paged, "has_amx", lambda: amx)
        with_avx512 = cpu_paged.long_query_paths(kernel_has_avx512=True)
        assert list(with_avx512) == [torch.bfloat16, torch.int8, torch.uint8]
        for dtype, rule in zip(with_avx512, (rules[0], rules[1], rules[1])):
            path = with_avx512[dtype]()
            if ext is None or not ext.has_bf16_products():
                assert path is None
            else:
                assert path.bf16_products and (path.min_query_len, path.min_query_key_pairs) == rule


# ------------------------------------------------------------------------------------------ end to end

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17],
           [300] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _llm(folder, dtype, **kwargs) -> LLM:
    return LLM(folder, dtype=dtype, kv_cache_memory=1 << 22, attention_backend="cpu_paged", **kwargs)


def _taking_every_chunk(dtype: torch.dtype, taken: list[int]):
    """Long-query paths of a CPU that sends every prompt and chunk of 2 tokens or more here (decodes stay)."""
    def make():
        path = sdpa_prefill.SdpaPrefill(2, 1)
        attend = path.attend
        path.attend = lambda out, q, *rest: (taken.append(q.shape[0]), attend(out, q, *rest))
        return path
    return lambda has_avx512: {dtype: make}


def test_engine_greedy_equal_with_the_path_on_and_off(paged, llama_dir, monkeypatch):
    def greedy(**kwargs) -> list[list[int]]:
        outs = _llm(llama_dir, "float32", **kwargs).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                               use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    monkeypatch.setattr(cpu_paged, "long_query_paths", lambda has_avx512: {})
    off = greedy()
    taken = []
    monkeypatch.setattr(cpu_paged, "long_query_paths", _taking_every_chunk(torch.float32, taken))
    for kwargs in CHUNKINGS:  # float32: the same tokens
        assert greedy(**kwargs) == off
    assert taken
