"""Prefill attention in tiled matrix products (folio.attention.flash_prefill), float32 and bf16 products, against a
float64 reference, from bf16 and 8-bit caches, and through the backend (given as the bf16 path, whatever the CPU).

Tolerances (the inputs are bf16, the reference is float64 attention on those same values): an output is
rounded once to bf16 (2^-9 of its size, 2^-8 allowing for the sums before it); the products and sums are
float32 (2^-12 of the largest |v| allowed for them). bf16 products round each probability to bf16 (2^-9 of it)
and divide by the sum of the rounded ones, so the output is a mean of V's rows with weights off by 2^-9 each:
within 2^-9 of max |v - output| <= 2 max |v|, 2^-8 of the largest |v|.
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
from test_kv_cache_8bit import on_code_grid
from test_sliding_window import plain_attention


@pytest.fixture(scope="module")
def flash_kernel(paged):  # noqa: F811 (builds the paged kernel or skips first)
    if flash_prefill.KERNEL.load() is None:
        pytest.fail(f"the bf16 prefill kernel did not build: {flash_prefill.KERNEL.error}")


def needs_products(bf16_products: bool) -> None:
    if bf16_products and not flash_prefill.KERNEL.load().has_bf16_products():
        pytest.skip("bf16 products need AVX512-BF16 (this CPU runs float32 products only)")


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


def check_close(out, exact, values, bf16_products=False):
    v_max = values.float().abs().max().item()
    bound = exact.abs() * 2 ** -8 + v_max * (2 ** -8 if bf16_products else 2 ** -12) + 1e-5
    err = (out.double() - exact).abs()
    assert not err.isnan().any()
    assert (err <= bound).all(), (err - bound).max()


PRODUCTS = pytest.mark.parametrize("bf16_products", [False, True], ids=["fp32-products", "bf16-products"])


def attend_all(q, cache, layout, params, bf16_products=False):
    """Every request of the layout through the path, from a cache the reference backend has written."""
    metadata = cpu_paged.CPUPagedAttentionBackend(long_queries={}).build_metadata(layout)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    path = flash_prefill.FlashPrefill(1, 1, bf16_products=bf16_products)
    path.attend(out, q, cache[0], cache[1], metadata.reqs, metadata.block_tables, params.scale_for(q.shape[-1]),
                params)
    return out


# (query length, context length): queries not a multiple of a query tile, chunks after context that ends or
# starts mid-block and mid key tile, a one-token query and a two-token prompt
SPECS = [(300, 300), (37, 1000), (129, 129), (1, 50), (2, 2), (200, 333)]


@PRODUCTS
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_the_reference(flash_kernel, block_size, group, head_dim, bf16_products):
    needs_products(bf16_products)
    q, k, v, cache, layout = make_step(SPECS, block_size, 2, group, head_dim, torch.bfloat16,
                                       seed=block_size * 100 + group * 10 + head_dim)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, AttentionParams(), bf16_products)
    check_close(out, reference(q, written, layout, AttentionParams()), written[1], bf16_products)


@pytest.mark.parametrize("params", [
    AttentionParams(sliding_window=1), AttentionParams(sliding_window=17), AttentionParams(sliding_window=150),
    AttentionParams(scale=0.3, logit_softcap=3.0), AttentionParams(sliding_window=40, logit_softcap=5.0),
], ids=["window-1", "window-17", "window-150", "softcap", "window-softcap"])
@PRODUCTS
def test_windows_and_soft_capping(flash_kernel, params, bf16_products):
    # blocks wholly before a request's window hold NaN: reading one makes the output NaN
    needs_products(bf16_products)
    specs = [(300, 300), (37, 1000), (64, 200), (3, 500)]
    q, k, v, cache, layout = make_windowed_step(specs, 16, 2, 3, 64, torch.bfloat16, params.sliding_window, seed=7)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, params, bf16_products)
    check_close(out, reference(q, written, layout, params), torch.nan_to_num(written[1]), bf16_products)


@PRODUCTS
def test_scores_that_grow_past_floats_range(flash_kernel, bf16_products):
    """Each key's score is its position (base e; bf16 rounds k to steps of 2 keys from 256 on, of 4 from 512): over
    a tile of keys a row's scores grow by far more than float32's 2^128, so its running max must move with them
    (bf16 products keep it until a tile's max passes it by 2^8), or the probabilities overflow."""
    needs_products(bf16_products)
    specs = [(700, 700), (300, 300)]
    q, k, v, cache, layout = make_step(specs, 16, 2, 7, 64, torch.bfloat16, seed=13)
    position = torch.cat([torch.arange(query_len) for query_len, _ in specs]).float()
    q = torch.full(q.shape, 0.5, dtype=torch.bfloat16)  # q . k / sqrt(64) = position where k = position / 4
    k = (position / 4)[:, None, None].expand(k.shape).to(torch.bfloat16).contiguous()
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, AttentionParams(), bf16_products)
    check_close(out, reference(q, written, layout, AttentionParams()), written[1], bf16_products)


@PRODUCTS
def test_each_weight_of_the_softmax(flash_kernel, bf16_products):
    """V's rows one-hot (key t's at dimension t), so each output is one key's softmax weight, checked one by one:
    within 2^-7 of the exact weight, relative (the bf16 probability's rounding, its share of the rounded sum's and
    the output's are 2^-9 each). The bound on the whole output elsewhere would miss an exponential off by 1 %."""
    needs_products(bf16_products)
    specs = [(64, 64)] * 4
    q, k, v, cache, layout = make_step(specs, 16, 1, 1, 64, torch.bfloat16, seed=21)
    gen = torch.Generator().manual_seed(5)
    q = torch.full(q.shape, 0.25, dtype=torch.bfloat16)
    k = (torch.randn(k.shape, generator=gen) * 2).to(torch.bfloat16)  # scores spread over several units
    v = torch.eye(64).repeat(len(specs), 1).reshape(v.shape).to(torch.bfloat16)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    out = attend_all(q, written, layout, AttentionParams(), bf16_products).double()
    exact = reference(q, written, layout, AttentionParams())
    weights = exact > 1e-3
    assert (((out - exact).abs() / exact)[weights] <= 2 ** -7).all()


def test_a_negative_scale_stays_on_the_kernel(flash_kernel):
    """The path's softmax scales the scores' max, the max of the scaled scores only for a positive scale: it
    declines other scales (no model here has one), and the paged kernel attends those long queries."""
    path = flash_prefill.FlashPrefill(1, 1, bf16_products=False)
    params = AttentionParams(scale=-0.125)
    q, k, v, cache, layout = make_step([(300, 300), (40, 90)], 16, 2, 7, 64, torch.bfloat16, seed=3)
    assert path.supports(AttentionParams(), q) and not path.supports(params, q)
    backend = cpu_paged.CPUPagedAttentionBackend(long_queries={torch.bfloat16: lambda: path})
    written = (cache[0].clone(), cache[1].clone())
    with torch.inference_mode():
        out = backend.forward(q, k, v, written, backend.build_metadata(layout), params)
    check_close(out, reference(q, written, layout, params), written[1], bf16_products=True)


@pytest.mark.parametrize("rule", [flash_prefill.FLOAT32_PRODUCTS, flash_prefill.BF16_PRODUCTS], ids=["fp32", "bf16"])
def test_backend_takes_long_bf16_queries_there(flash_kernel, rule):
    # through the backend: long requests to the path, decodes and short chunks to the kernel
    bf16_products = rule == flash_prefill.BF16_PRODUCTS
    needs_products(bf16_products)
    backend = cpu_paged.CPUPagedAttentionBackend(
        long_queries={torch.bfloat16: lambda: flash_prefill.FlashPrefill(*rule, bf16_products=bf16_products)})
    path = backend.long_query_path(torch.bfloat16)
    long_len = max(path.min_query_len, int(path.min_query_key_pairs ** 0.5) + 1)
    specs = [(long_len + 37, long_len + 37), (1, 50), (long_len, 3 * long_len + 5), (1, 9)]
    q, k, v, cache, layout = make_step(specs, 16, 2, 7, 64, torch.bfloat16, seed=11)
    split = backend.build_metadata(layout).split_for(torch.bfloat16, path)
    assert split.long_reqs[:, 1].tolist() == [long_len + 37, long_len]
    out, written = run(backend, q, k, v, cache, layout)
    _, ref_cache = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    assert torch.equal(written[0], ref_cache[0]) and torch.equal(written[1], ref_cache[1])
    check_close(out, reference(q, written, layout, AttentionParams()), written[1], bf16_products)


@pytest.mark.parametrize("name", list(KV_QUANTIZATIONS))
@pytest.mark.parametrize("dtype,bf16_products", [(torch.bfloat16, False), (torch.float32, False),
                                                 (torch.bfloat16, True)], ids=["bf16", "fp32", "bf16-products"])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 7, 16), (80, 2, 5)])
def test_8bit_caches_attend_as_their_dequantised_values(flash_kernel, name, dtype, bf16_products, head_dim, group,
                                                        block_size):
    # the 8-bit rows the paged kernel wrote, against float64 attention on their values (codes times scales)
    needs_products(bf16_products)
    quant = KV_QUANTIZATIONS[name]
    q, k, v, cache, layout = make_step(SPECS, block_size, 2, group, head_dim, dtype, seed=head_dim + group)
    cache = tuple(quant.quantize(c) for c in cache)
    _, written = run(cpu_paged.CPUPagedAttentionBackend(long_queries={}), q, k, v, cache, layout)
    values = tuple(quant.dequantize(c, torch.float32) for c in written)
    out = attend_all(q, written, layout, AttentionParams(), bf16_products)
    assert out.dtype == dtype
    check_close(out, reference(q, values, layout, AttentionParams()), values[1], bf16_products)


@pytest.mark.parametrize("name", list(KV_QUANTIZATIONS))
@pytest.mark.parametrize("params", [AttentionParams(), AttentionParams(sliding_window=40),
                                    AttentionParams(sliding_window=40, logit_softcap=5.0)],
                         ids=["full", "window", "window-softcap"])
def test_bf16_products_of_an_8bit_cache_equal_a_bf16_cache_of_its_values(flash_kernel, name, params):
    """Rows whose scales are powers of two hold the same values as a bf16 cache: their codes go in as bf16
    exactly, and a scale that is a power of two moves no rounding of a score or of a probability, so both caches
    attend bit for bit alike, but where a probability times a scale falls below float's normal range (1.2e-38),
    which the rounding to bf16 flushes to zero: a power of two moves which ones do (outputs of 1e-35 differ)."""
    needs_products(True)
    q, _, _, cache, layout = make_step([(300, 300), (37, 1000), (64, 200), (3, 500)], 16, 2, 3, 64,
                                       torch.bfloat16, seed=5)
    written = tuple(on_code_grid(name, c.float(), 3 + i) for i, c in enumerate(cache))
    quant = KV_QUANTIZATIONS[name]
    codes = tuple(quant.quantize(c) for c in written)
    assert all(bool((quant.dequantize(c, torch.bfloat16) == w).all()) for c, w in zip(codes, written))
    out8 = attend_all(q, codes, layout, params, bf16_products=True)
    out16 = attend_all(q, written, layout, params, bf16_products=True)
    assert not bool((out8 != out16).logical_and((out8.float() - out16.float()).abs() > 1e-30).any())


# ------------------------------------------------------------------------------------------ end to end

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17],
           [300] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _greedy_bf16(folder, **kwargs) -> list[list[int]]:
    llm = LLM(folder, dtype="bfloat16", kv_cache_memory=1 << 22, attention_backend="cpu_paged", **kwargs)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CHUNKINGS = ({}, {"max_num_batched_tokens": 7, "block_size": 4})  # whole prompts; chunked prefill


def taking_every_chunk(taken: list[int], bf16_products: bool = False):
    """long_query_paths of a CPU that sends every prompt and prefill chunk of 2 tokens or more to the path (decodes
    stay on the kernel), from bf16 and 8-bit caches, noting each call's tokens in taken."""
    def make():
        path = flash_prefill.FlashPrefill(2, 1, bf16_products=bf16_products)
        attend = path.attend
        path.attend = lambda out, q, *rest: (taken.append(q.shape[0]), attend(out, q, *rest))
        return path
    dtypes = [torch.bfloat16] + [quant.storage_dtype for quant in KV_QUANTIZATIONS.values()]
    return lambda has_avx512: {dtype: make for dtype in dtypes}


def test_engine_greedy_equal_with_the_path_on_and_off(flash_kernel, llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_paged, "long_query_paths", lambda has_avx512: {})
    off = _greedy_bf16(llama_dir)
    taken = []
    monkeypatch.setattr(cpu_paged, "long_query_paths", taking_every_chunk(taken))
    # float32 products differ from the kernel's float32 loop only in the order of sums: the same tokens
    for kwargs in CHUNKINGS:
        assert _greedy_bf16(llama_dir, **kwargs) == off
    assert taken


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_engine_prompt_logprobs_as_close_with_bf16_products(flash_kernel, llama_dir, monkeypatch, kv_cache_dtype):
    # bf16 products round the probabilities over other tiles than the kernel does, so a greedy path may flip at a
    # near-tie: instead, the prompt's logprobs must be as close to float32's with the path as without (the same
    # cache format both ways)
    needs_products(True)
    prompt = PROMPTS[2]

    def logprob_errors(exact=None, dtype="bfloat16", **kwargs) -> torch.Tensor:
        llm = LLM(llama_dir, dtype=dtype, kv_cache_memory=1 << 22, attention_backend="cpu_paged", **kwargs)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        got = torch.tensor([e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])
        return got if exact is None else (got - exact).abs()

    monkeypatch.setattr(cpu_paged, "long_query_paths", lambda has_avx512: {})
    exact = logprob_errors(dtype="float32")
    off = logprob_errors(exact, kv_cache_dtype=kv_cache_dtype)
    taken = []
    monkeypatch.setattr(cpu_paged, "long_query_paths", taking_every_chunk(taken, bf16_products=True))
    for kwargs in CHUNKINGS:
        on = logprob_errors(exact, kv_cache_dtype=kv_cache_dtype, **kwargs)
        assert on.max() <= 1.25 * off.max() + 0.01 and on.mean() <= 1.25 * off.mean() + 0.002, (on, off)
    assert taken


@pytest.mark.parametrize("case", ["float32 q", "odd head_dim"])
def test_bf16_products_refuse_what_they_do_not_take(flash_kernel, case):
    # a float32 model's q with an 8-bit cache, or an odd head_dim: the backend keeps them on the kernel
    needs_products(True)
    head_dim = 63 if case == "odd head_dim" else 64
    q, k, v, cache, layout = make_step([(20, 20)], 16, 2, 2, head_dim, torch.bfloat16, seed=3)
    if case == "float32 q":
        q = q.float()
        cache = tuple(KV_QUANTIZATIONS["int8"].quantize(c) for c in cache)
    metadata = cpu_paged.CPUPagedAttentionBackend(long_queries={}).build_metadata(layout)
    path = flash_prefill.FlashPrefill(1, 1, bf16_products=True)
    assert not path.supports(AttentionParams(), q)
    assert flash_prefill.FlashPrefill(1, 1).supports(AttentionParams(), q)  # float32 products take both
    with pytest.raises(RuntimeError, match="bf16 products take bf16 q, head_dim even"):
        path.attend(torch.empty_like(q), q, cache[0], cache[1], metadata.reqs, metadata.block_tables, 0.125,
                    AttentionParams())
