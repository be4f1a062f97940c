"""The executor of tensor-parallel ranks as Ray actors: one actor per rank, placed by Ray (on this machine, or
on the nodes of the Ray cluster the process is connected to).

The engine connects to Ray where it already is (`ray.init` called before, or RAY_ADDRESS set), else starts a
local instance for itself and stops it at shutdown. Each actor builds its Worker (the rank meets the others
over torch.distributed at the engine's node address), then serves calls; each step's SchedulerOutput is put in
Ray's object store once and every actor reads it from there. An actor that raises fails the call with its
exception (a ValueError as itself), and one that dies ends the engine with a WorkerError.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from folio.config import EngineConfig
from folio.core.step_contract import ModelRunnerOutput, SchedulerOutput
from folio.distributed.parallel_state import free_port
from folio.executor.executor import Executor, WorkerError
from folio.loader.model_loader import describe_model
from folio.worker.worker import KVCacheNeeds

logger = logging.getLogger("folio")


class RankActor:
    """A Ray actor around one rank's Worker: `call` runs one of the worker's methods."""

    def start(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from folio.worker.worker import Worker

        self.worker = Worker(config, rank, init_method)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import ray

        self.description = describe_model(config.model.model)
        ranks = config.parallel.tensor_parallel_size
        self.started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
        if self.started_ray:
            ray.init(num_cpus=max(ranks, len(os.sched_getaffinity(0))), include_dashboard=False,
                     log_to_driver=False)
        elif not ray.is_initialized():
            ray.init()  # the cluster RAY_ADDRESS names
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < ranks:  # the actors Ray cannot place would leave the others waiting for them
            if self.started_ray:
                ray.shutdown()
            raise ValueError(f"tensor_parallel_size {ranks}: the Ray cluster has {cpus:g} CPUs, and each rank's "
                             f"actor takes one")
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        actor = ray.remote(num_cpus=1)(RankActor)
        self.actors = [actor.remote() for _ in range(ranks)]
        try:
            self._get([a.start.remote(config, rank, init_method) for rank, a in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel Ray actors ready (%s)", ranks, init_method)

    def kv_cache_needs(self) -> KVCacheNeeds:
        return self._call("kv_cache_needs")

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._call("initialize_cache", num_blocks, max_model_len)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        import ray

        return self._call("execute", ray.put(scheduler_output))

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()

    def _call(self, method: str, *args: Any) -> Any:
        return self._get([actor.call.remote(method, *args) for actor in self.actors])[0]

    def _get(self, refs: list) -> list:
        """Every rank's answer; a dead actor ends the engine (the others may be waiting for it in a
        collective)."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self.shutdown()
            raise WorkerError(f"a tensor-parallel Ray actor died: {e}") from None

