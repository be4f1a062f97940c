"""Sliding-window attention, the softmax scale and soft-capped scores, in both attention backends, against a
plain dense reference written out here (one request at a time, explicit masks, float64).

Each request's context comes from a shuffled paged cache; blocks wholly before a sliding layer's window are
poisoned with NaN (the KV cache manager frees them, so their table entries may point anywhere): a backend
that reads one returns NaN. Decodes, whole prompts and prefill chunks after cached context, in one batch.
"""

from __future__ import annotations

import math
import random
import shutil
from typing import Optional

import pytest
import torch

from folio.attention import cpu_paged
from folio.attention.backend import AttentionParams, BatchLayout
from folio.attention.torch_sdpa import TorchSDPABackend

# (query length, context length once the step's tokens are in)
MIXED = [(1, 1), (1, 5), (1, 17), (1, 100), (7, 7), (33, 33), (20, 50), (5, 130), (64, 200), (2, 2), (1, 40)]


@pytest.fixture(scope="module", params=["cpu_paged", "torch_sdpa"])
def backend(request):
    if request.param == "torch_sdpa":
        return TorchSDPABackend()
    if cpu_paged.load_extension() is None:
        if shutil.which("c++") is None or shutil.which("ninja") is None:
            pytest.skip(f"no C++ toolchain: {cpu_paged.extension_error()}")
        pytest.fail(f"the CPU paged attention kernel did not build: {cpu_paged.extension_error()}")
    return cpu_paged.CPUPagedAttentionBackend()


def plain_attention(q, k, v, positions_q, positions_k, params: AttentionParams) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D] of one request, in float64: softmax over the visible keys."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * params.scale_for(q.shape[-1])
    if params.logit_softcap is not None:
        scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap
    visible = positions_k[None, :] <= positions_q[:, None]
    if params.sliding_window is not None:
        visible &= positions_k[None, :] > positions_q[:, None] - params.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if params.sinks is not None:  # one more score per head, whose probability weighs no value
        sinks = params.sinks.double().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.einsum("hnl,lhd->nhd", torch.softmax(torch.cat([scores, sinks], -1), dim=-1)[..., :-1], v)
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def make_step(specs, block_size, num_kv_heads, group, head_dim, dtype, window: Optional[int], seed=0):
    """A shuffled paged cache holding each request's context; the blocks before a window hold NaN."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, start = [], 0
    for (qlen, seq_len), n in zip(specs, need):
        table = ids[start:start + n]
        start += n
        if window is not None:
            first_key = max(0, seq_len - qlen - window + 1)  # of the request's first query
            for i in range(first_key // block_size):  # wholly before the window: freed, unspecified
                k_cache[table[i]] = float("nan")
                v_cache[table[i]] = float("nan")
        tables.append(table)
    num_tokens = sum(q for q, _ in specs)
    hq = group * num_kv_heads
    q = (torch.randn(num_tokens, hq, head_dim, generator=gen) * 2).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    layout = BatchLayout.from_lists([q for q, _ in specs], [s for _, s in specs], tables, block_size)
    return q, k, v, (k_cache, v_cache), layout


def expected(step, params: AttentionParams) -> torch.Tensor:
    q, k, v, (k_cache, v_cache), layout = step
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, start = layout.block_size, 0
    for qlen, seq_len, table in zip(layout.query_lens.tolist(), layout.seq_lens.tolist(), layout.block_tables):
        off = seq_len - qlen
        first = 0 if params.sliding_window is None else max(0, off - params.sliding_window + 1)
        pos = torch.arange(first, off)
        slots = table.long()[pos // bs] * bs + pos % bs
        keys = torch.cat([k_cache.flatten(0, 1)[slots], k[start:start + qlen]])
        values = torch.cat([v_cache.flatten(0, 1)[slots], v[start:start + qlen]])
        out[start:start + qlen] = plain_attention(q[start:start + qlen], keys, values, torch.arange(off, seq_len),
                                                  torch.arange(first, seq_len), params)
        start += qlen
    return out


def check(backend, step, params: AttentionParams, dtype):
    q, k, v, cache, layout = step
    cache = (cache[0].clone(), cache[1].clone())
    with torch.inference_mode():
        out = backend.forward(q, k, v, cache, backend.build_metadata(layout), params)
    want = expected(step, params)
    assert not out.isnan().any(), "read a block outside the window"
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=2e-2)
    # the step's own K/V went into the cache at its slots
    slots = layout.slot_mapping
    assert torch.equal(cache[0].flatten(0, 1)[slots], k) and torch.equal(cache[1].flatten(0, 1)[slots], v)


@pytest.mark.parametrize("window", [None, 1, 3, 16, 37, 1000])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sliding_window(backend, window, block_size, dtype):
    step = make_step(MIXED, block_size, 2, 3, 64, dtype, window, seed=block_size + (window or 0))
    check(backend, step, AttentionParams(sliding_window=window), dtype)


@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])
@pytest.mark.parametrize("window", [None, 8, 37])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 2, 8), (128, 1, 8), (40, 4, 8), (256, 2, 8), (64, 7, 8),
                                                       (128, 4, 8), (64, 7, 16), (256, 8, 32)])
def test_scale_and_softcap(backend, softcap, window, head_dim, group, block_size):
    # Gemma's query_pre_attn_scalar: a scale other than head_dim ** -0.5; Gemma 2's soft-capped scores.
    # head_dim 40 runs the kernel's scalar path, 256 (Gemma's) its widest vector one; groups of 4 and 7 its
    # grouped-query decode path in bf16 (on AMX with blocks of 16 or 32, from a window's first key rounded down to
    # a tile of 16)
    params = AttentionParams(scale=1 / math.sqrt(head_dim / 2), sliding_window=window, logit_softcap=softcap)
    for dtype in (torch.float32, torch.bfloat16):
        step = make_step(MIXED, block_size, 2, group, head_dim, dtype, window, seed=head_dim + block_size)
        check(backend, step, params, dtype)


def test_window_with_context_split_across_threads(backend):
    # few long decodes and chunks on 2 threads: the paged kernel splits the keys into partitions
    if isinstance(backend, cpu_paged.CPUPagedAttentionBackend):
        backend = cpu_paged.CPUPagedAttentionBackend(min_split_keys=16, min_parallel_work=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for specs in ([(1, 1000)], [(1, 333), (1, 17)], [(3, 500)], [(9, 100)]):
            for window in (None, 5, 64, 200):
                for dtype in (torch.float32, torch.bfloat16):
                    step = make_step(specs, 16, 2, 7, 64, dtype, window, seed=len(specs))
                    check(backend, step, AttentionParams(sliding_window=window, logit_softcap=30.0), dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_window_with_8bit_cache(backend, cache_dtype):
    # the 8-bit cache's rows, read back dequantised, through the same window
    from folio.attention.kv_quant import KV_QUANTIZATIONS

    quant = KV_QUANTIZATIONS[cache_dtype]
    q, k, v, (k_cache, v_cache), layout = make_step(MIXED, 8, 2, 2, 64, torch.float32, 9, seed=5)
    rows = (quant.quantize(k_cache), quant.quantize(v_cache))
    params = AttentionParams(sliding_window=9)
    with torch.inference_mode():
        out = backend.forward(q, k, v, (rows[0].clone(), rows[1].clone()), backend.build_metadata(layout), params)
    deq = (quant.dequantize(rows[0], torch.float32), quant.dequantize(rows[1], torch.float32))
    # the step's own keys also go through the 8-bit rows
    want = expected((q, quant.dequantize(quant.quantize(k), torch.float32),
                     quant.dequantize(quant.quantize(v), torch.float32), deq, layout), params)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_params():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionParams(sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        AttentionParams(logit_softcap=0.0)


@pytest.mark.parametrize("name", ["cpu_paged", "torch_sdpa"])
def test_mistral_window_matches_transformers(tmp_path, monkeypatch, name):
    # Mistral's sliding_window applies to every layer (Transformers applies it; folio used to ignore it)
    from conftest import build_tiny_model, hf_greedy
    from folio import LLM, SamplingParams

    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", name)
    folder = build_tiny_model(str(tmp_path / "mistral-w8"), "mistral", sliding_window=8)
    prompts = [list(range(20, 61)), [5, 6, 7, 8, 9]]
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=7)
    assert llm.llm_engine.model_config.sliding_windows == (8, 8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 20) for p in prompts]
