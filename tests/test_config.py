"""EngineConfig: flat option names reach their group, unknown names and bad values are refused by name."""

from __future__ import annotations

import pytest
import torch

from folio import LLMEngine
from folio.config import CacheOptions, EngineConfig, ModelOptions, ParallelOptions, SchedulerOptions, engine_options


def test_flat_names_land_in_their_groups():
    config = EngineConfig.from_kwargs(model="m", dtype="float32", max_model_len=64, seed=3, block_size=8,
                                      kv_cache_memory=0.5, enable_prefix_caching=False, max_num_seqs=2,
                                      max_num_batched_tokens=32, scheduling_policy="priority", num_threads=1)
    assert config == EngineConfig(
        model=ModelOptions(model="m", dtype="float32", max_model_len=64, seed=3),
        cache=CacheOptions(block_size=8, kv_cache_memory=0.5, enable_prefix_caching=False),
        scheduler=SchedulerOptions(max_num_seqs=2, max_num_batched_tokens=32, scheduling_policy="priority"),
        parallel=ParallelOptions(num_threads=1))
    assert EngineConfig.from_kwargs() == EngineConfig()


def test_option_names_are_unique_across_groups():
    names = [option.name for _, option, _ in engine_options()]
    assert len(names) == len(set(names))


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="block_sise"):
        EngineConfig.from_kwargs(block_sise=8)
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLMEngine.from_kwargs(None, max_num_seq=2)  # refused before any model loads


@pytest.mark.parametrize("option,value,message", [
    ("block_size", 0, "block_size must be >= 1, got 0"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be >= 1, got 0"),
    ("max_model_len", 1, "max_model_len must be >= 2, got 1"),
    ("scheduling_policy", "lifo", "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"),
    ("kv_cache_memory", 1.5, "kv_cache_memory must be a byte count"),
    ("kv_cache_memory", 1, "kv_cache_memory must be a byte count"),
    ("dtype", "int8", "dtype must be one of auto"),
])
def test_bad_value_names_the_option(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**{option: value})


def test_torch_dtype():
    assert ModelOptions(dtype="bf16").torch_dtype == torch.bfloat16
    assert ModelOptions(dtype=torch.float16).torch_dtype == torch.float16
    assert ModelOptions().torch_dtype in (torch.bfloat16, torch.float32)  # auto: what this CPU does fast
