"""CPUPagedAttentionBackend equals the torch SDPA reference: outputs within tolerance, cache writes identical.

Random paged caches with shuffled block ids, mixed batches (decodes, prefills, prefill chunks after cached
context), GQA ratios 1/3/7, head_dim 64/128 (and odd sizes), fp32 and bf16; then greedy generation through
the engine equal to Transformers'. The first test to need the kernel builds it (~15 s on 2 cores, once per
machine: later runs load it from ~/.cache/folio/torch_extensions).
"""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import EOS_ID, VOCAB, hf_greedy, write_tokenizer
from folio import LLM, SamplingParams
from folio.attention import cpu_paged
from folio.attention.backend import BatchLayout
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.platforms import current_platform

# (query length, context length once the step's tokens are in): decodes, whole prompts, chunks after context
MIXED = [(1, 1), (1, 5), (1, 17), (1, 100), (1, 384), (7, 7), (33, 33), (20, 50), (5, 130), (64, 200), (2, 2)]

ENV_VAR = "FOLIO_ATTENTION_BACKEND"


@pytest.fixture(scope="module")
def paged():
    if cpu_paged.load_extension() is None:
        if shutil.which("c++") is None or shutil.which("ninja") is None:
            pytest.skip(f"no C++ toolchain: {cpu_paged.extension_error()}")
        pytest.fail(f"the CPU paged attention kernel did not build: {cpu_paged.extension_error()}")
    return cpu_paged.CPUPagedAttentionBackend()


def make_step(specs, block_size, num_kv_heads, group, head_dim, dtype, seed=0, spare_blocks=5):
    """A random cache, shuffled non-contiguous block tables, and q/k/v as views of one fused projection."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n] + [ids[-1]] * rng.randint(0, 2))  # tables may run past the context
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q for q, _ in specs)
    hq = group * num_kv_heads
    fused = (torch.randn(num_tokens, (hq + 2 * num_kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    q, k, v = fused.split([hq * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, hq, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    layout = BatchLayout.from_lists([q for q, _ in specs], [s for _, s in specs], tables, block_size)
    return q, k, v, (k_cache, v_cache), layout


def run(backend, q, k, v, cache, layout):
    cache = (cache[0].clone(), cache[1].clone())
    with torch.inference_mode():
        out = backend.forward(q, k, v, cache, backend.build_metadata(layout))
    return out, cache


def check_against_reference(backend, step, dtype):
    q, k, v, cache, layout = step
    ref, ref_cache = run(TorchSDPABackend(), *step)
    out, new_cache = run(backend, *step)
    assert out.dtype == dtype and out.shape == q.shape
    for new, ref_rows in zip(new_cache, ref_cache):  # the same bits (NaN where a test left unwritten slots NaN)
        torch.testing.assert_close(new, ref_rows, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
        # both see the same bf16 inputs: against float32 attention on them, the kernel must be about as close
        # as the reference (float32, rounded once). The kernel rounds the probabilities to bf16 for P.V, as
        # torch's CPU flash attention does: an output moves by at most 2^-9 of the largest |v| before its own
        # rounding to bf16 (at most 2^-8 of its size from there).
        exact, _ = run(TorchSDPABackend(), q.float(), k.float(), v.float(),
                       (cache[0].float(), cache[1].float()), layout)
        err_new = (out.float() - exact).abs()
        err_ref = (ref.float() - exact).abs()
        v_max = max(cache[1].float().nan_to_num(0.0).abs().max().item(), v.float().abs().max().item())
        bound = v_max * 2 ** -9 + exact.abs() * 2 ** -8 + 1e-4
        assert (err_new <= bound).all(), (err_new - bound).max()
        assert err_new.mean() <= 1.25 * err_ref.mean(), (err_new.mean(), err_ref.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_matches_reference(paged, block_size, group, head_dim, dtype):
    step = make_step(MIXED, block_size, 2, group, head_dim, dtype, seed=block_size * 100 + group * 10 + head_dim)
    check_against_reference(paged, step, dtype)


@pytest.mark.parametrize("group", [2, 5])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 80, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_other_head_dims(paged, head_dim, dtype, group):
    # 16/80: vector path with an odd number of 16-lane chunks (bf16 widened to float32); 32/96/256: bf16 dot
    # products with 1, 3 and 8 chunks of 32 (12, 4 and 1 rows of accumulators in registers), and with 5 query
    # heads per kv head the bf16 decodes take the grouped-query decode path; 40: scalar path. On AVX2: 32/96/256
    # hold 4 vectors of a row's accumulator in registers for P.V, 80 holds 2; 16 and 40 take the scalar path
    step = make_step(MIXED[:8] + [(1, 200)], 8, 3, group, head_dim, dtype, seed=head_dim)
    check_against_reference(paged, step, dtype)


# decodes whose context ends on each side of a tile of 16 keys and of a step of 64
DECODES = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 63), (1, 64), (1, 65), (1, 130), (1, 321)]


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
@pytest.mark.parametrize("group,kv_heads", [(4, 4), (5, 4), (8, 3), (16, 2), (17, 1)])
def test_grouped_query_decodes(paged, head_dim, group, kv_heads):
    # bf16 decodes of 4 to 17 query heads per kv head in blocks of 32: on AMX the path that multiplies K's
    # rows in place (the kv heads of an item side by side in 16 lanes: groups of 4 heads of 4, 3 heads of 5, 2 of
    # 8, one of 16; 17 is the vector path's); elsewhere the vector path
    step = make_step(DECODES, 32, kv_heads, group, head_dim, torch.bfloat16, seed=head_dim + group)
    check_against_reference(paged, step, torch.bfloat16)


@pytest.mark.parametrize("group,head_dim", [(7, 64), (16, 128)])
def test_unwritten_slots_never_reach_a_decode(paged, group, head_dim):
    """The slots of a request's last block past its context (and every block no request holds) may hold anything,
    NaN included: a decode reads whole tiles of 16 or 32 keys, and no such slot may reach its output."""
    step = make_step(DECODES, 32, 2, group, head_dim, torch.bfloat16, seed=group)
    q, k, v, (k_cache, v_cache), layout = step
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, seq_len in zip(layout.block_tables.tolist(), layout.seq_lens.tolist()):
        for t in range(int(seq_len)):
            written[table[t // 32], t % 32] = True
    for cache in (k_cache, v_cache):
        cache[~written] = float("nan")
    check_against_reference(paged, step, torch.bfloat16)


def test_decode_paths(paged):
    """Which path takes a bf16 decode: AMX's where the CPU has it (4-16 query heads per kv head, blocks of a
    multiple of 16 slots), else the vector path (AVX512-BF16), else the general one."""
    from folio.platforms.cpu_features import has_amx, has_fast_bf16

    ext = cpu_paged.load_extension()
    grouped = "amx" if has_amx() else "vector" if has_fast_bf16() and ext.has_avx512() else "general"
    vector = "vector" if grouped != "general" else "general"
    for quantized in (False, True):
        assert ext.decode_path(64, 7, 16, quantized) == grouped
        assert ext.decode_path(128, 16, 32, quantized) == grouped
        assert ext.decode_path(256, 4, 64, quantized) == grouped
        assert ext.decode_path(64, 7, 8, quantized) == vector  # blocks of 8: a tile of 16 keys spans two
        assert ext.decode_path(64, 17, 16, quantized) == vector  # more query heads than lanes
        assert ext.decode_path(64, 3, 16, quantized) == "general"
        assert ext.decode_path(80, 7, 16, quantized) == "general"
        assert ext.decode_path(224, 7, 16, quantized) == "general"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_context_split_across_threads(paged, dtype):
    # few, long decodes on 2 threads: each context is cut into partitions merged afterwards (flash-decoding)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        backend = cpu_paged.CPUPagedAttentionBackend(min_split_keys=16, min_parallel_work=0)
        for specs in ([(1, 1000)], [(1, 333), (1, 17)], [(3, 500)], [(9, 100)], [(1, 16), (1, 64)]):
            check_against_reference(backend, make_step(specs, 16, 2, 7, 64, dtype, seed=len(specs)), dtype)
    finally:
        torch.set_num_threads(threads)


def test_single_token_blocks_and_long_chunk(paged):
    check_against_reference(paged, make_step([(1, 9), (40, 40), (3, 12)], 1, 1, 4, 64, torch.float32), torch.float32)
    check_against_reference(paged, make_step([(300, 300), (130, 1000)], 16, 2, 3, 64, torch.bfloat16),
                            torch.bfloat16)


def test_unsupported_dtype_uses_reference(paged):
    step = make_step(MIXED[:6], 16, 2, 3, 64, torch.float16)
    ref, ref_cache = run(TorchSDPABackend(), *step)
    out, cache = run(paged, *step)
    assert torch.equal(out, ref) and torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])


def test_bad_block_table_is_an_error(paged):
    q, k, v, cache, layout = make_step([(1, 40)], 16, 2, 1, 64, torch.float32)
    layout.block_tables = layout.block_tables[:, :1]  # a 40-token context needs 3 blocks
    with pytest.raises(ValueError, match="block table"):
        paged.build_metadata(layout)


def test_platform_selects_the_backend(paged, monkeypatch):
    platform = current_platform()
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert isinstance(platform.attention_backend(None), cpu_paged.CPUPagedAttentionBackend)
    assert type(platform.attention_backend("torch_sdpa")) is TorchSDPABackend
    monkeypatch.setenv(ENV_VAR, "torch_sdpa")
    assert type(platform.attention_backend(None)) is TorchSDPABackend
    assert isinstance(platform.attention_backend("cpu_paged"), cpu_paged.CPUPagedAttentionBackend)  # option wins
    monkeypatch.setenv(ENV_VAR, "cpu_paged")
    assert isinstance(platform.attention_backend(None), cpu_paged.CPUPagedAttentionBackend)
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match="FOLIO_ATTENTION_BACKEND"):
        platform.attention_backend(None)
    with pytest.raises(ValueError, match="attention_backend must be one of cpu_paged, torch_sdpa"):
        platform.attention_backend("flash")


def test_build_failure_falls_back(monkeypatch, caplog):
    from folio import csrc_build

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(csrc_build, "build_and_load", broken)
    fresh = csrc_build.CppKernel(cpu_paged.KERNEL.ext_name, cpu_paged.KERNEL.source, cpu_paged.KERNEL.what,
                                 cpu_paged.KERNEL.fallback)
    monkeypatch.setattr(cpu_paged, "KERNEL", fresh)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="folio"):
        backend = current_platform().attention_backend("cpu_paged")
    assert type(backend) is TorchSDPABackend
    assert "no compiler" in caplog.text
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_paged.CPUPagedAttentionBackend()


def test_second_process_loads_the_cached_build(paged):
    code = ("import time; t = time.perf_counter(); from folio.attention import cpu_paged; "
            "assert cpu_paged.load_extension() is not None, cpu_paged.extension_error(); "
            "print(time.perf_counter() - t)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 10 and time.perf_counter() - start < 30  # no rebuild


# ------------------------------------------------------------------------------------------ end to end

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17],
           [300] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture
def engine_uses_paged(paged, monkeypatch):
    """Every ModelRunner built in the test gets the paged backend, whatever the environment says."""
    monkeypatch.setenv(ENV_VAR, "cpu_paged")


def test_engine_option_chooses_the_backend(llama_dir, paged, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cpu_paged")  # the option wins over the environment
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, attention_backend="torch_sdpa")
    assert type(llm.llm_engine.runner.backend) is TorchSDPABackend
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, attention_backend="flash")


def _generate(folder, **kwargs):
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 22, **kwargs)
    assert isinstance(llm.llm_engine.runner.backend, cpu_paged.CPUPagedAttentionBackend)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_engine_greedy_matches_transformers(tiny_model_factory, engine_uses_paged):
    folder = tiny_model_factory("qwen2")  # head_dim 16, 2 query heads per kv head, q/k/v biases
    expected = [hf_greedy(folder, p, GREEDY.max_tokens) for p in PROMPTS]
    assert _generate(folder) == expected
    # chunked prefill (chunks after cached context mixed with decodes) and 4-token blocks
    assert _generate(folder, max_num_batched_tokens=7, block_size=4) == expected


def test_engine_greedy_head_dim_64_gqa_3(tmp_path, engine_uses_paged):
    # conftest's tiny models have head_dim 16 and 2 query heads per kv head: this one has the kernel's main
    # shape (head_dim 64, as SmolLM2 and Qwen2) and 3 query heads per kv head
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                                   eos_token_id=EOS_ID, pad_token_id=0, initializer_range=0.2)
    torch.manual_seed(0)
    folder = str(tmp_path / "llama-hd64-gqa3")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    write_tokenizer(folder)
    expected = [hf_greedy(folder, p, GREEDY.max_tokens) for p in PROMPTS]
    assert _generate(folder, max_num_batched_tokens=16) == expected
