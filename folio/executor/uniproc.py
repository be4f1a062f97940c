"""The executor of one rank: the worker lives in the engine's process, and a step is a call."""

from __future__ import annotations

from typing import Any

from folio.config import EngineConfig
from folio.executor.executor import Executor
from folio.loader.model_loader import ModelDescription
from folio.worker.model_runner import ModelRunner
from folio.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, num_threads=config.parallel.num_threads)
        loaded = self.worker.loaded
        self.description = ModelDescription(loaded.path, loaded.config, loaded.tokenizer, loaded.eos_token_ids)

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    def _call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)
