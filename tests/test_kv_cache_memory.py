"""The KV cache's budget is address space: resident memory grows with the blocks written, not with the budget
(folio.memory.zeros_on_demand), never-written slots read as zeros, and engines on such a cache still match
Transformers."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import hf_greedy
from folio import LLM, SamplingParams
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.core.block_pool import BlockPool
from folio.memory import zeros_on_demand
from folio.worker.kv_cache import KVCacheSpec

GIB = 1 << 30


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@pytest.mark.parametrize("cache_dtype,dtype", [("auto", torch.float32), ("auto", torch.bfloat16),
                                               ("int8", torch.bfloat16), ("fp8", torch.float32)])
def test_a_1gib_cache_costs_resident_memory_only_for_the_blocks_written(cache_dtype, dtype):
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, cache_dtype=cache_dtype)
    backend = TorchSDPABackend()
    num_blocks = GIB // spec.bytes_per_block(backend)
    gc.collect()
    before = _status_mib("VmRSS")
    caches = spec.allocate(backend, num_blocks, torch.device("cpu"))
    assert _status_mib("VmRSS") - before < 16  # zeros would make all 1024 MiB resident
    for k, v in caches:
        assert k.dtype == v.dtype == spec.storage_dtype and k.shape == spec.layer_shape(backend, num_blocks)
        assert not k[:8].any() and not v[-8:].any()  # never written reads as zeros, and reading faults nothing in
        k[:8] = 1  # the first blocks, as a small workload writes them
    assert _status_mib("VmRSS") - before < 16
    assert all(bool((k[:8] == 1).all()) for k, _ in caches)


def test_the_mapping_goes_with_the_last_view():
    gc.collect()
    before = _status_mib("VmSize")
    t = zeros_on_demand((256, 1 << 20), torch.float32)
    view = t[3]
    del t
    gc.collect()
    assert _status_mib("VmSize") - before > 1000  # the view keeps the 1 GiB mapping
    del view
    gc.collect()
    assert _status_mib("VmSize") - before < 100


def test_the_pool_hands_out_low_block_ids_first():
    """So a small workload writes, and makes resident, only the first pages of the cache."""
    pool = BlockPool(1000)
    first = pool.allocate(3)
    assert [b.block_id for b in first] == [0, 1, 2]
    pool.free(first)
    assert sorted(b.block_id for b in pool.allocate(4)) == [0, 1, 2, 3]


def test_an_engine_on_a_1gib_cache_matches_transformers_without_its_resident_cost(llama_dir):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 61))]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22)  # imports and kernels in before measuring
    gc.collect()
    before = _status_mib("VmRSS")
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=GIB)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert _status_mib("VmRSS") - before < 256
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 16) for p in prompts]
