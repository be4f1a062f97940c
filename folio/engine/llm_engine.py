"""LLMEngine: step-level control of the engine (add_request, step, abort_request).

Data flows one way through a step: scheduler -> model runner -> scheduler bookkeeping -> output
processing. The scheduler and the runner only exchange the step contract's messages (folio.core.step_contract). Requests that a stop string ended in output processing are finished in the scheduler at once,
so their blocks are free before the next step.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Iterable, Optional, Union

import torch

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import RequestStatus
from folio.core.scheduler import Scheduler, SchedulerStats
from folio.engine.input_processor import InputProcessor, PromptType
from folio.engine.output_processor import OutputKind, OutputProcessor
from folio.loader.model_loader import load_model
from folio.memory import available_memory_bytes, keep_freed_memory
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer
from folio.worker.model_runner import ModelRunner

logger = logging.getLogger("folio")

DEFAULT_KV_CACHE_BYTES = 4 << 30
DEFAULT_KV_CACHE_FRACTION = 0.4


def kv_cache_budget(setting: Union[int, float, None]) -> int:
    """Bytes for the KV cache: an explicit byte count, a fraction of available memory, or the default
    (the smaller of 4 GiB and 40% of available memory, like vLLM's CPU build's 4 GiB default)."""
    if isinstance(setting, int):
        return setting
    if isinstance(setting, float):
        return int(setting * available_memory_bytes())
    return min(DEFAULT_KV_CACHE_BYTES, int(DEFAULT_KV_CACHE_FRACTION * available_memory_bytes()))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        torch.set_num_threads(config.parallel.num_threads or len(os.sched_getaffinity(0)))
        keep_freed_memory()  # every step's large activations reuse the heap instead of faulting pages in
        torch.manual_seed(config.model.seed)
        dtype = config.model.torch_dtype
        loaded = load_model(config.model.model, dtype, config.model.max_model_len)
        self.model_config = cfg = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        if config.model.max_model_len is not None and config.model.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {config.model.max_model_len} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        max_model_len = config.model.max_model_len or cfg.max_position_embeddings

        bytes_per_block = cfg.kv_bytes_per_token * dtype.itemsize * config.cache.block_size
        num_blocks = kv_cache_budget(config.cache.kv_cache_memory) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for even one block of {bytes_per_block} bytes")
        capacity = num_blocks * config.cache.block_size
        if capacity < max_model_len:
            logger.warning("KV cache holds %d tokens, fewer than max_model_len %d: lowering max_model_len to %d",
                           capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); max concurrency at %d tokens per "
                    "request: %.1fx", num_blocks, config.cache.block_size, capacity,
                    num_blocks * bytes_per_block / 2**20, max_model_len, capacity / max_model_len)

        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager, max_model_len)
        self.runner = ModelRunner(loaded.model, cfg, dtype, num_blocks, config.cache.block_size,
                                  config.scheduler.max_num_seqs, max_model_len)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size, max_model_len, loaded.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info("engine ready: %s (%s, %s) in %.1f s", loaded.path, cfg.architecture, dtype,
                    time.perf_counter() - start)

    @classmethod
    def from_kwargs(cls, model: Optional[str] = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Validate, tokenize and queue a request; raises ValueError (naming the field) for bad input."""
        params = params or SamplingParams()
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        processed = self.input_processor.process_prompt(prompt)
        requests = self.input_processor.make_requests(request_id, processed, params, priority, arrival_time)
        self.output_processor.add_request(request_id, processed, params, output_kind, arrival_time)
        for request in requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """End requests now and free their blocks; returns their final (aborted) outputs."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(rid), RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(rid)
            if output is not None:
                outputs.append(output)
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (for users who swap weights); running requests are unaffected."""
        self.scheduler.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
