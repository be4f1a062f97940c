"""The executor of tensor-parallel ranks as Ray actors on this machine: one actor per rank, on a Ray instance
the process already runs (`ray.init` called before, or RAY_ADDRESS set to a local one), else on one the engine
starts for itself and stops at shutdown.

Each actor takes an equal share of the free CPUs (and as many threads; actors are not pinned to cores), builds
its Worker (the ranks meet over torch.distributed on this machine), then serves calls; each step's SchedulerOutput is put in
Ray's object store once and every actor reads it from there, and only rank 0 sends its answer back. As with the
`mp` executor, a ValueError while the actors start reaches the caller as it is, and any error after that (or an
actor that dies) stops every actor and ends the engine with a WorkerError: the other ranks may be waiting in a
collective for the one that failed. Ranks on several machines of a Ray cluster (placement groups, a rendezvous
on a node of their own) are not done.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from folio import thread_count
from folio.config import EngineConfig
from folio.core.step_contract import ModelRunnerOutput, SchedulerOutput
from folio.distributed import shm_all_reduce
from folio.distributed.placement import free_port
from folio.executor.executor import Executor, WorkerError
from folio.loader.model_loader import describe_model

logger = logging.getLogger("folio")

PLACEMENT_TIMEOUT_S = 60.0  # for Ray to place the actors on this node: beyond it, the CPUs are taken


class RankActor:
    """A Ray actor around one rank's Worker: `call` runs one of the worker's methods; rank 0 answers."""

    def start(self, config: EngineConfig, rank: int, init_method: str, threads: int) -> None:
        from folio.worker.worker import Worker

        self.rank = rank
        self.worker = Worker(config, rank, init_method, threads)

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return result if self.rank == 0 else None


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.description = describe_model(config.model.model)
        ranks = config.parallel.tensor_parallel_size
        self.started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
        if self.started_ray:  # a Ray of its own, even where `ray start` runs one on this machine
            ray.init(address="local", num_cpus=max(ranks, thread_count.default()), include_dashboard=False,
                     log_to_driver=False)
        elif not ray.is_initialized():
            ray.init()  # the instance RAY_ADDRESS names
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.actors: list = []
        self.held_cpus = 0
        self.started = False
        self._finalizer = weakref.finalize(self, _stop, self.actors, self.started_ray,
                                           shm_all_reduce.buffer_path(init_method))
        try:
            cpus = int(ray.available_resources().get("CPU", 0)) // ranks
            self.held_cpus = cpus * ranks
            if cpus < 1:  # the actors Ray cannot place would leave the others waiting for them
                raise ValueError(f"tensor_parallel_size {ranks}: Ray has "
                                 f"{ray.available_resources().get('CPU', 0):g} free CPUs, and each rank's actor "
                                 f"takes one at least")
            threads = config.parallel.num_threads or cpus
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            actor = ray.remote(num_cpus=cpus, scheduling_strategy=here)(RankActor)
            self.actors.extend(actor.remote() for _ in range(ranks))
            placed, _ = ray.wait([a.__ray_ready__.remote() for a in self.actors], num_returns=ranks,
                                 timeout=PLACEMENT_TIMEOUT_S)
            if len(placed) < ranks:  # this node's CPUs are taken (the free ones may be on other nodes)
                raise ValueError(f"tensor_parallel_size {ranks}: Ray placed {len(placed)} of the {ranks} actors of "
                                 f"{cpus} CPUs on this node within {PLACEMENT_TIMEOUT_S:g} s")
            self._get([a.start.remote(config, rank, init_method, threads) for rank, a in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise
        self.started = True
        logger.info("%d tensor-parallel Ray actors ready (%s, %d threads each)", ranks, init_method, threads)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        import ray

        return self._call("execute", ray.put(scheduler_output))

    def shutdown(self) -> None:
        import ray

        held = bool(self.actors) and not self.started_ray
        self._finalizer()
        if held and ray.is_initialized():  # a next engine on this Ray finds their CPUs free again (unless taken)
            deadline = time.monotonic() + 3
            while ray.available_resources().get("CPU", 0) < self.held_cpus and time.monotonic() < deadline:
                time.sleep(0.05)

    def _call(self, method: str, *args: Any) -> Any:
        return self._get([actor.call.remote(method, *args) for actor in self.actors])[0]

    def _get(self, refs: list) -> list:
        """Every rank's answer. An error stops every actor (the others may be waiting in a collective for the
        one that failed): while they start, a ValueError is raised as it is; otherwise a WorkerError."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self.shutdown()
            raise WorkerError(f"a tensor-parallel Ray actor died: {e}") from None
        except Exception as e:
            self.shutdown()
            if self.started or not isinstance(e, ValueError):
                raise WorkerError(f"a tensor-parallel Ray actor failed: {e}") from e
            raise


def _stop(actors: list, started_ray: bool, shm_path: str) -> None:
    """Kill the actors (and the Ray instance the engine started), when the engine shuts down or is collected."""
    import ray

    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
    actors.clear()
    shm_all_reduce.remove_buffer(shm_path)
