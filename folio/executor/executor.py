"""The executor seam: how the engine core reaches its workers, wherever they run.

The engine asks for the model's description (config, tokenizer), the KV cache the workers need per block, then
has them allocate the blocks it sized, and from then on sends each step's SchedulerOutput and reads rank 0's
ModelRunnerOutput. Each of these is one call of a Worker method on every rank (`_call`). The step contract's
messages are plain data (folio.core.step_contract), so a worker in another process receives them as pickles.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from folio.core.step_contract import ModelRunnerOutput, SchedulerOutput
from folio.loader.model_loader import ModelDescription
from folio.worker.model_runner import ModelRunner
from folio.worker.worker import KVCacheNeeds


class WorkerError(RuntimeError):
    """A worker failed outside the engine's own checks (which raise ValueError), or is gone: the engine cannot
    step any more."""


class Executor(ABC):
    description: ModelDescription

    @abstractmethod
    def _call(self, method: str, *args: Any) -> Any:
        """Run the Worker method on every rank; rank 0's result."""

    def kv_cache_needs(self) -> KVCacheNeeds:
        """Rank 0's KV cache per block (every rank holds the same share of each block)."""
        return self._call("kv_cache_needs")

    def initialize_cache(self, num_blocks: int, max_model_len: int, max_num_seqs: int) -> None:
        """Every worker allocates num_blocks blocks (and max_num_seqs rows of recurrent states), builds its model
        runner and warms it up."""
        self._call("initialize_cache", num_blocks, max_model_len, max_num_seqs)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every worker; rank 0's answer."""
        return self._call("execute", scheduler_output)

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it runs in the engine's process (benchmarks and tests look inside it)."""
        raise AttributeError(f"the model runners of the {type(self).__name__} live in its worker processes")

    def shutdown(self) -> None:
        """Stop the workers (none to stop by default)."""
