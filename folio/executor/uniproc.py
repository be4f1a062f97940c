"""The executor of one rank: the worker lives in the engine's process, and a step is a call."""

from __future__ import annotations

from folio.config import EngineConfig
from folio.core.step_contract import ModelRunnerOutput, SchedulerOutput
from folio.executor.executor import Executor
from folio.loader.model_loader import ModelDescription
from folio.worker.model_runner import ModelRunner
from folio.worker.worker import KVCacheNeeds, Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        loaded = self.worker.loaded
        self.description = ModelDescription(loaded.path, loaded.config, loaded.tokenizer, loaded.eos_token_ids)

    @property
    def runner(self) -> ModelRunner:
        """The model runner itself (benchmarks and tests look inside it)."""
        return self.worker.runner

    def kv_cache_needs(self) -> KVCacheNeeds:
        return self.worker.kv_cache_needs()

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)
