"""Prefill attention in tiled float32 matrix products (folio.attention.flash_prefill) against a float64 reference,
from bf16 and 8-bit caches, and through the backend (given as the bf16 path, whatever the CPU).

Tolerances (the inputs are bf16, the reference is float64 attention on those same values): an output is
rounded once to bf16 (2^-9 of its size, 2^-8 allowing for the sums before it); the products and sums are
float32 (2^-12 of the largest |v| allowed for them).
"""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.attention import cpu_paged, flash_prefill
from folio.attention.backend import AttentionParams
from folio.attention.kv_quant import KV_QUANTIZATIONS
from test_cpu_paged_attention import make_step, paged, run  # noqa: F401 (fixture)
from test_sliding_window import make_step as make_windowed_step
from test_sliding_window import plain_attention


@pytest.fixture(scope="module")
def flash_kernel(paged):  # noqa: F811 (builds the paged kernel or skips first)
    if flash_prefill.KERNEL.load() is None:
        pytest.fail(f"the bf16 prefill kernel did not build: {flash_prefill.KERNEL.error}")


def reference(q, cache, layout, params):
    """Each request's attention in float64 from the written cache (its context from the window of its first
    query: blocks before that are unspecified)."""
    k_cache, v_cache = cache
    out = torch.zeros(q.shape, dtype=torch.float64)
    first = 0
    for i, (qlen, seq_len) in enumerate(zip(layout.query_lens.tolist(), layout.seq_lens.tolist())):
        first_key = max(0, seq_len - qlen - params.sliding_window + 1) if params.sliding_window else 0
        slots = torch.tensor([layout.block_tables[i, t // layout.block_size].item() * layout.block_size
                              + t % layout.block_size for t in range(first_key, seq_len)])
        keys = k_cache.flatten(0, 1)[slots]
        values = v_cache.flatten(0, 1)[slots]
        out[first:first + qlen] = plain_attention(q[first:first + qlen], keys, values,
                                                  torch.arange(seq_len - qlen, seq_len),
                                                  torch.arange(first_key, seq_len), params)
        first += qlen
    return out


def check_close(out, exact, values):
    v_max = values.float().abs().max().item()
    bound = exact.abs() * 2 ** -8 + v_max * 2 ** -12 + 1e-5
    err = (out.double() - exact).abs()
    assert not err.isnan().any()
    assert (err <= bound).all(), (err - bound).max()


def attend_all(q, cache, layout, params):
    """Every request of the layout through the path, from a cache the reference backend has written."""
    metadata = cpu_paged.CPUPagedAttentionBackend(long_queries={}).build_metadata(layout)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    path = flash_prefill.FlashPrefill(1, 1)
    path.attend(out, q, cache[0], cache[1], metadata.reqs, metadata.block_tables, params.scale_for(q.shape[-1]),
                params)
    return out


# (query length, context length): queries not a multiple of a query tile, chunks after context that ends or
# starts mid-block and mid key tile, a one-token query and a two-token prompt
SPECS = [(300, 300), (37, 1000), (129, 129), (1, 50), (2, 2), (200, 333)]


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_the_reference(flash_kernel, block_size, group, head_dim):
    q, k, v, cache, layout = make_step(SPECS, block_size, 2, group, head_dim, torch.bfloat16,
                                       seed=block_size * 100 + group * 10 + head_dim)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, AttentionParams())
    check_close(out, reference(q, written, layout, AttentionParams()), written[1])


@pytest.mark.parametrize("params", [
    AttentionParams(sliding_window=1), AttentionParams(sliding_window=17), AttentionParams(sliding_window=150),
    AttentionParams(scale=0.3, logit_softcap=3.0), AttentionParams(sliding_window=40, logit_softcap=5.0),
], ids=["window-1", "window-17", "window-150", "softcap", "window-softcap"])
def test_windows_and_soft_capping(flash_kernel, params):
    # blocks wholly before a request's window hold NaN: reading one makes the output NaN
    specs = [(300, 300), (37, 1000), (64, 200), (3, 500)]
    q, k, v, cache, layout = make_windowed_step(specs, 16, 2, 3, 64, torch.bfloat16, params.sliding_window, seed=7)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, params)
    check_close(out, reference(q, written, layout, params), torch.nan_to_num(written[1]))


def test_backend_takes_long_bf16_queries_there(flash_kernel):
    # the path this CPU picks, through the backend: long requests to it, decodes and short chunks to the kernel
    backend = cpu_paged.CPUPagedAttentionBackend(long_queries={torch.bfloat16: flash_prefill.FlashPrefill})
    path = backend.long_query_path(torch.bfloat16)
    long_len = max(path.min_query_len, int(path.min_query_key_pairs ** 0.5) + 1)
    specs = [(long_len + 37, long_len + 37), (1, 50), (long_len, 3 * long_len + 5), (1, 9)]
    q, k, v, cache, layout = make_step(specs, 16, 2, 7, 64, torch.bfloat16, seed=11)
    split = backend.build_metadata(layout).split_for(torch.bfloat16, path)
    assert split.long_reqs[:, 1].tolist() == [long_len + 37, long_len]
    out, written = run(backend, q, k, v, cache, layout)
    _, ref_cache = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    assert torch.equal(written[0], ref_cache[0]) and torch.equal(written[1], ref_cache[1])
    check_close(out, reference(q, written, layout, AttentionParams()), written[1])


@pytest.mark.parametrize("name", list(KV_QUANTIZATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 7, 16), (80, 2, 5)])
def test_8bit_caches_attend_as_their_dequantised_values(flash_kernel, name, dtype, head_dim, group, block_size):
    # the 8-bit rows the paged kernel wrote, against float64 attention on their values (codes times scales)
    quant = KV_QUANTIZATIONS[name]
    q, k, v, cache, layout = make_step(SPECS, block_size, 2, group, head_dim, dtype, seed=head_dim + group)
    cache = tuple(quant.quantize(c) for c in cache)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    values = tuple(quant.dequantize(c, torch.float32) for c in written)
    out = attend_all(q, written, layout, AttentionParams())
    assert out.dtype == dtype
    check_close(out, reference(q, values, layout, AttentionParams()), values[1])


# ------------------------------------------------------------------------------------------ end to end

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17],
           [300] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _greedy_bf16(folder, **kwargs) -> list[list[int]]:
    llm = LLM(folder, dtype="bfloat16", kv_cache_memory=1 << 22, attention_backend="cpu_paged", **kwargs)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_engine_greedy_equal_with_the_path_on_and_off(flash_kernel, llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_paged, "long_query_paths", lambda has_avx512: {})
    off = _greedy_bf16(llama_dir)
    taken = []

    def on():  # every prompt and prefill chunk of 2 tokens or more; decodes stay on the kernel
        path = flash_prefill.FlashPrefill(2, 1)
        attend = path.attend
        path.attend = lambda out, q, *rest: (taken.append(q.shape[0]), attend(out, q, *rest))
        return path

    monkeypatch.setattr(cpu_paged, "long_query_paths", lambda has_avx512: {torch.bfloat16: on})
    # float32 products differ from the kernel's float32 loop only in the order of sums: the same tokens
    for kwargs in ({}, {"max_num_batched_tokens": 7, "block_size": 4}):  # whole prompts; chunked prefill
        assert _greedy_bf16(llama_dir, **kwargs) == off
    assert taken
