"""Worker: what one rank of the engine runs, in the engine's process or a process of its own.

A worker keeps to the cores its executor gives it, joins its tensor-parallel group (folio.distributed), loads its slice
of the model (a draft model's too), and reports the KV cache it needs per block and a hybrid model's recurrent states
per request; the engine sizes the cache and max_num_seqs from rank 0's report and then has every worker allocate them
and warm up (`initialize_cache`). From then on each step's SchedulerOutput goes to every worker, each runs the same
forward over its slice of the layers, and the ranks' partial sums meet in the row-parallel layers' all-reduce, so
each rank holds the same hidden states, samples the same tokens from the same seeds and keeps the same per-request
state. The engine reads rank 0's answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from folio.config import EngineConfig
from folio.core.step_contract import ModelRunnerOutput, SchedulerOutput
from folio.distributed.parallel_state import init_tensor_parallel
from folio.loader.model_loader import LoadedModel, load_model
from folio.models.recurrent_state import request_state_bytes
from folio.platforms import current_platform
from folio.spec_decode.draft_model import load_draft_model
from folio.worker.kv_cache import KVCacheSpec
from folio.worker.model_runner import ModelRunner
from folio.worker.warm_up import warm_up


@dataclass(frozen=True)
class KVCacheNeeds:
    """A rank's KV cache, per block: the target's spec (and a draft model's), their bytes under its backend; and
    the bytes of one request's recurrent states (a hybrid model's: folio.models.recurrent_state; 0 for others)."""

    specs: list[KVCacheSpec]
    bytes_per_block: int
    attention_backend: str
    state_bytes_per_seq: int = 0


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: Optional[str] = None,
                 num_threads: Optional[int] = None, cores: Optional[list[int]] = None) -> None:
        """num_threads: torch threads (None: the platform's default); cores: the CPUs to keep to (None: any)."""
        self.config = config
        self.platform = platform = current_platform()
        if cores:
            os.sched_setaffinity(0, cores)
        platform.prepare_process(num_threads)
        ranks = config.parallel.tensor_parallel_size
        if ranks > 1:
            init_tensor_parallel(rank, ranks, distributed_init_method, platform.distributed_backend)
        torch.manual_seed(config.model.seed)  # every rank draws the same random numbers
        dtype = config.model.torch_dtype
        self.loaded: LoadedModel = load_model(
            config.model.model, dtype, config.model.max_model_len,
            lambda model: platform.linear_method(model, config.model.weight_scheme), platform.device,
            gguf_native=config.model.gguf_as_stored)
        cfg = self.loaded.config
        if config.model.max_model_len is not None and config.model.max_model_len > cfg.max_context:
            raise ValueError(f"max_model_len {config.model.max_model_len} exceeds the model's context of "
                             f"{cfg.max_context} positions")
        self.backend = platform.attention_backend(config.model.attention_backend)
        max_model_len = config.model.max_model_len or cfg.max_context
        spec = config.speculative.speculative_config
        self.draft = None if spec is None or spec.method != "draft_model" else \
            load_draft_model(spec, cfg, dtype, max_model_len, config.cache.block_size, platform)
        # sliding-window layers get KV cache groups of their own, whose old blocks are freed. A draft model reads the
        # tables of the target's full-attention group (its catch-ups read whole contexts): where every layer slides
        # (Mistral, Phi-3) there is none, and beside a draft model the cache keeps one group of every layer
        windows = () if self.draft and None not in cfg.sliding_windows else cfg.sliding_windows
        self.kv_cache_spec = KVCacheSpec.for_model(cfg.for_tensor_parallel(ranks), config.cache.block_size, dtype,
                                                   config.cache.kv_cache_dtype, windows)
        self.runner: Optional[ModelRunner] = None

    def kv_cache_needs(self) -> KVCacheNeeds:
        specs = [self.kv_cache_spec] + ([self.draft.kv_cache_spec] if self.draft else [])
        return KVCacheNeeds(specs, sum(spec.bytes_per_block(self.backend) for spec in specs),
                            type(self.backend).__name__,
                            request_state_bytes(self.loaded.model, self.kv_cache_spec.dtype))

    def initialize_cache(self, num_blocks: int, max_model_len: int, max_num_seqs: int) -> None:
        """Allocate num_blocks blocks of KV cache (and max_num_seqs rows of recurrent states), build the model
        runner and warm it up."""
        config = self.config
        self.runner = ModelRunner(self.loaded.model, self.kv_cache_spec, num_blocks, max_num_seqs,
                                  max_model_len, self.backend, self.platform.device,
                                  config.speculative.speculative_config, self.draft,
                                  step_threads=self.platform.step_threads)
        warm_up(self.runner, config.cache.block_size, max_model_len)  # the first request runs warm

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)
