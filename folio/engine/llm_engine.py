"""LLMEngine: step-level control of the engine (add_request, step, abort_request).

Data flows one way through a step: scheduler -> grammar bitmask (structured outputs) -> model runner ->
scheduler bookkeeping -> output processing. The scheduler and the runner only exchange the step contract's
messages (folio.core.step_contract). Requests that a stop string ended in output processing are finished in the
scheduler at once, so their blocks are free before the next step. What depends on the hardware (dtype
"auto", the KV budget, the attention backend, the linear method, the device) comes from the platform.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Iterable, Optional, Union

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import RequestStatus
from folio.core.scheduler import Scheduler, SchedulerStats
from folio.engine.input_processor import InputProcessor, Params, PromptType
from folio.engine.output_processor import OutputKind, OutputProcessor
from folio.executor import make_executor
from folio.executor.executor import Executor
from folio.models.model_config import ModelConfig
from folio.outputs import EngineOutput
from folio.platforms import current_platform
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams
from folio.structured_output.manager import StructuredOutputManager
from folio.tokenizer import Tokenizer
from folio.worker.model_runner import ModelRunner
from folio.worker.worker import KVCacheNeeds

logger = logging.getLogger("folio")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.platform = current_platform()
        # the workers load the model (in this process, or one process per tensor-parallel rank: folio.executor)
        self.executor = executor = make_executor(config)
        try:
            self._start(config, executor, start)
        except BaseException:
            executor.shutdown()  # its workers, which a failed engine would otherwise keep while it is referenced
            raise

    def _start(self, config: EngineConfig, executor: Executor, start: float) -> None:
        """Everything after the workers loaded the model: the KV cache sized and allocated, the core's parts."""
        described = executor.description
        self.model_config = cfg = described.config
        self.tokenizer: Tokenizer = described.tokenizer
        needs = executor.kv_cache_needs()
        spec = config.speculative.speculative_config
        draft_model = spec is not None and spec.method == "draft_model"  # writes the KV of its guesses ahead
        num_lookahead_tokens = spec.num_speculative_tokens if draft_model else 0
        num_blocks, self.max_model_len, max_num_seqs = self._size_kv_cache(
            needs, config.model.max_model_len or cfg.max_context, num_lookahead_tokens)
        kv_cache_spec = needs.specs[0]
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               self._prefix_caching(config, cfg),
                                               [group.window for group in kv_cache_spec.groups])
        # a draft model writes the KV of its guesses past each step's tokens: slots are reserved for them
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler, max_num_seqs=max_num_seqs),
                                   self.kv_cache_manager, self.max_model_len, num_lookahead_tokens)
        warm_start = time.perf_counter()
        # and warms up: the first request runs warm
        executor.initialize_cache(num_blocks, self.max_model_len, max_num_seqs)
        warm_s = time.perf_counter() - warm_start
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size, self.max_model_len,
                                              described.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(config.structured_outputs, self.tokenizer, cfg.vocab_size,
                                                         described.eos_token_ids)
        self._ids = itertools.count()
        ranks = config.parallel.tensor_parallel_size
        logger.info("engine ready: %s (%s, %s, %s attention%s) in %.1f s (warm-up %.2f s)", described.path,
                    cfg.architecture, config.model.torch_dtype, needs.attention_backend,
                    f", {ranks} tensor-parallel ranks" if ranks > 1 else "", time.perf_counter() - start, warm_s)

    @staticmethod
    def _prefix_caching(config: EngineConfig, cfg: ModelConfig) -> bool:
        """Whether the KV cache manager reuses cached prefixes: as configured, except for a model with recurrent
        layers, whose states follow each request's own tokens (folio.models.recurrent_state): a cached prefix has
        K/V, not the states after it. Nor can those states take back rejected drafts: speculative decoding is
        refused there."""
        if not cfg.recurrent_layers:
            return config.cache.enable_prefix_caching
        if config.speculative.speculative_config is not None:
            raise ValueError(f"speculative decoding is not supported for {cfg.architecture}: its recurrent layers' "
                             "states cannot take back rejected draft tokens")
        if config.cache.enable_prefix_caching:
            logger.info("prefix caching is off: %s's recurrent layers keep per-request states, which a cached prefix "
                        "does not have", cfg.architecture)
        return False

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it runs in this process (benchmarks and tests look inside it)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the worker processes, if any (they also stop when the engine is collected or the process exits)."""
        self.executor.shutdown()

    def _size_kv_cache(self, needs: KVCacheNeeds, max_model_len: int,
                       num_lookahead_tokens: int) -> tuple[int, int, int]:
        """The number of blocks the platform's KV budget holds (a block: the KV of every model that keeps some,
        the target's and a draft model's, on every tensor-parallel rank: each holds its share of the heads) once
        a hybrid model's recurrent states have theirs (`_rows_of_states`), max_model_len lowered so that one
        request of that length and the lookahead slots reserved past it fit in them, and max_num_seqs."""
        bytes_per_block = needs.bytes_per_block * self.config.parallel.tensor_parallel_size
        budget = self.platform.kv_cache_budget(self.config.cache.kv_cache_memory)
        block_size = self.config.cache.block_size
        target, chunk = needs.specs[0], self.config.scheduler.max_num_batched_tokens

        def blocks_for(num_tokens: int) -> int:  # the most one request of num_tokens holds
            return target.max_blocks(num_tokens + num_lookahead_tokens, chunk)

        state_bytes = needs.state_bytes_per_seq * self.config.parallel.tensor_parallel_size
        max_num_seqs = self._rows_of_states(state_bytes, budget, blocks_for(max_model_len) * bytes_per_block,
                                            bytes_per_block)
        num_blocks = (budget - max_num_seqs * state_bytes) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for even one block of {bytes_per_block} bytes")
        capacity = num_blocks * block_size - num_lookahead_tokens  # tokens, as full attention holds them
        if blocks_for(max_model_len) > num_blocks:
            low, high = 0, max_model_len  # the longest request that fits: blocks_for grows with its length
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if blocks_for(mid) <= num_blocks else (low, mid - 1)
            logger.warning("KV cache holds a request of %d tokens at most, fewer than max_model_len %d: lowering "
                           "max_model_len to %d", low, max_model_len, low)
            max_model_len = low
        if max_model_len < 1:
            raise ValueError(f"kv_cache_memory is too small for a request of even one token ({num_blocks} blocks)")
        logger.info("KV cache (%s): %d blocks of %d tokens (%d tokens, %.1f MiB); max concurrency at %d tokens per "
                    "request: %.1fx", target.dtype if target.cache_dtype == "auto" else target.cache_dtype,
                    num_blocks, block_size, capacity, num_blocks * bytes_per_block / 2**20, max_model_len,
                    num_blocks / blocks_for(max_model_len))
        if len(target.groups) > 1:
            kinds: dict[str, int] = {}
            for group in target.groups:
                kind = "full attention" if group.window is None else f"sliding window {group.window}"
                kinds[kind] = kinds.get(kind, 0) + 1
            held, full = blocks_for(max_model_len), target.full_attention_blocks(max_model_len + num_lookahead_tokens)
            logger.info("KV cache groups of %d layers (a block holds their K/V): %s; a request of %d tokens holds "
                        "at most %d blocks, %.0f without sliding groups (%.1f%%)", target.layers_per_block,
                        ", ".join(f"{kind} x{n}" for kind, n in kinds.items()), max_model_len, held, full,
                        100 * held / full)
        return num_blocks, max_model_len, max_num_seqs

    def _rows_of_states(self, state_bytes: int, budget: int, longest_request_bytes: int, bytes_per_block: int) -> int:
        """max_num_seqs: as configured, or for a model with recurrent layers (one request's states: state_bytes,
        every rank's), lowered so that the budget holds that many requests' states besides the KV of one request
        of max_model_len (longest_request_bytes); one at least, whose states and one block must fit (the blocks
        left then lower max_model_len). The states of every row are set aside whether or not a request is
        running in it: they are what lets max_num_seqs requests run at once."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        if not state_bytes:
            return max_num_seqs
        if budget < state_bytes + bytes_per_block:
            raise ValueError(f"kv_cache_memory ({budget} bytes) is too small for one request's recurrent states "
                             f"({state_bytes} bytes) and one block of KV cache ({bytes_per_block} bytes)")
        rows = min(max_num_seqs, max(1, (budget - longest_request_bytes) // state_bytes))
        if rows < max_num_seqs:
            logger.warning("the KV cache budget holds the recurrent states of %d requests (%.2f MiB each) besides the "
                           "KV of one request of max_model_len: lowering max_num_seqs from %d to %d", rows,
                           state_bytes / 2**20, max_num_seqs, rows)
        logger.info("recurrent states: %d rows of %.2f MiB (%.1f MiB of the KV cache budget)", rows,
                    state_bytes / 2**20, rows * state_bytes / 2**20)
        return rows

    @classmethod
    def from_kwargs(cls, model: Optional[str] = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[Params] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Validate, tokenize and queue a request; raises ValueError (naming the field) for bad input. With
        PoolingParams the request's one output is an EmbeddingRequestOutput."""
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        truncate = params.truncate_prompt_tokens if isinstance(params, (SamplingParams, PoolingParams)) else None
        processed = self.input_processor.process_prompt(prompt, truncate)  # (make_requests refuses other params)
        requests = self.input_processor.make_requests(request_id, processed, params, priority, arrival_time)
        if isinstance(params, SamplingParams):  # a pooling request samples nothing, so nothing constrains it
            self.structured_output.validate(params.structured_outputs)
            self.structured_output.add_requests(requests)
        self.output_processor.add_request(request_id, processed, params, output_kind, arrival_time)
        for request in requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[EngineOutput]:
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

    def step(self) -> list[EngineOutput]:
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(scheduler_output,
                                                                                  self.scheduler.requests)
        runner_output = self.executor.execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
