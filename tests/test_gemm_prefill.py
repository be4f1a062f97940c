"""Prefill attention in GEMMs (folio.attention.gemm_prefill) equals the torch SDPA reference, on any CPU: the
backend is made to use it whatever the CPU's features, in batches where it takes every request, some of them
(decodes and short chunks stay on the kernel), and with tiles small enough that a query spans several."""

from __future__ import annotations

import pytest
import torch

from folio.attention import cpu_paged, gemm_prefill
from test_cpu_paged_attention import check_against_reference, make_step, paged  # noqa: F401 (fixture)

LONG = 256  # query tokens: with its own keys, above both thresholds


@pytest.fixture
def gemm_backend(paged):  # noqa: F811 (the fixture builds the kernel or skips)
    return cpu_paged.CPUPagedAttentionBackend(gemm_prefill=True, flash_prefill=False)


def long_split(backend, layout, dtype):
    """The step's requests the backend's long-query path for dtype takes (None: none, or no such path)."""
    path = backend.long_query_path(dtype)
    return path and backend.build_metadata(layout).split_for(dtype, path)


@pytest.mark.parametrize("specs", [
    [(LONG, LONG)],  # one prompt, nothing else: the kernel only writes the cache
    [(LONG + 37, LONG + 37), (1, 50), (LONG, 3 * LONG + 5), (5, 9), (2 * LONG, 2 * LONG)],  # chunks after context
], ids=["prompt-only", "mixed"])
@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("block_size", [16, 4])
def test_long_queries_match_reference(gemm_backend, specs, group, block_size):
    step = make_step(specs, block_size, 2, group, 64, torch.float32, seed=group * 10 + block_size)
    assert long_split(gemm_backend, step[-1], torch.float32)  # the path under test is taken
    check_against_reference(gemm_backend, step, torch.float32)


def test_query_tiles_smaller_than_the_query(gemm_backend, monkeypatch):
    monkeypatch.setattr(gemm_prefill, "SCORE_TILE_BYTES", 4 * 2 * 3 * 400 * 5)  # 5 query tokens a tile
    step = make_step([(LONG + 3, 400), (1, 7)], 16, 2, 3, 64, torch.float32, seed=3)
    check_against_reference(gemm_backend, step, torch.float32)


def test_bf16_and_short_queries_stay_on_the_kernel(gemm_backend):
    few_pairs = int(gemm_prefill.MIN_QUERY_KEY_PAIRS ** 0.5) - 1
    step = make_step([(gemm_prefill.MIN_QUERY_LEN - 1, 2000), (few_pairs, few_pairs), (1, 30)], 16, 2, 3, 64,
                     torch.float32, seed=4)
    assert not long_split(gemm_backend, step[-1], torch.float32)
    check_against_reference(gemm_backend, step, torch.float32)
    step = make_step([(LONG, LONG)], 16, 2, 3, 64, torch.bfloat16, seed=5)  # long, but a bf16 cache
    assert not long_split(gemm_backend, step[-1], torch.bfloat16)
    check_against_reference(gemm_backend, step, torch.bfloat16)
