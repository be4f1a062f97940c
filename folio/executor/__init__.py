"""Executors: where an engine's workers (folio.worker.worker) run. `uni`: one worker in the engine's own process;
`mp`: one process per tensor-parallel rank (folio.executor.multiproc)."""

from __future__ import annotations

from folio.config import EngineConfig
from folio.executor.executor import Executor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from folio.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from folio.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
