"""Executors: where an engine's workers (folio.worker.worker) run. `uni`: one worker in the engine's own process;
`mp`: one process per tensor-parallel rank (folio.executor.multiproc); `ray`: one Ray actor per rank
(folio.executor.ray_executor)."""

from __future__ import annotations

from folio.config import EngineConfig
from folio.executor.executor import Executor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from folio.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from folio.executor.ray_executor import RayExecutor  # Ray is imported only where it is asked for

        return RayExecutor(config)
    from folio.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
