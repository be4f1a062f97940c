"""The executor of several tensor-parallel ranks: one worker process per rank, spawned by the engine.

Each worker process keeps to its share of the cores (folio.distributed.placement), builds its Worker (joining
the group over torch.distributed, loading its slice), then serves calls from a pipe: the engine pickles each
call once and sends the same bytes to every rank, and every rank answers (rank 0 with the result, the others
with an acknowledgement), so an error on any rank reaches the engine, and a worker that dies is noticed
rather than waited for. An error while the workers start (a ValueError: an option the model cannot take)
reaches the caller as it is; any error after that stops every worker and ends the engine with a WorkerError,
since the other ranks may be waiting in a collective for the one that failed. A worker whose engine is gone
reads the end of its pipe and exits.

Workers are started with `spawn` (forking a process whose OpenMP threads run would hang the child): a script
that makes an engine with several ranks must guard its entry point with `if __name__ == "__main__":`, as with
any multiprocessing program.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from folio import thread_count
from folio.config import EngineConfig
from folio.distributed import shm_all_reduce
from folio.distributed.placement import free_port, rank_cores
from folio.executor.executor import Executor, WorkerError
from folio.loader.model_loader import describe_model

logger = logging.getLogger("folio")

SHUTDOWN = "shutdown"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.description = describe_model(config.model.model)
        ranks = config.parallel.tensor_parallel_size
        share = max(1, thread_count.default() // ranks)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.processes: list = []
        self.connections: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.connections,
                                           shm_all_reduce.buffer_path(init_method))
        self.started = False
        try:
            for rank in range(ranks):
                ours, theirs = context.Pipe()
                self.connections.append(ours)
                cores = rank_cores(rank, ranks)
                threads = config.parallel.num_threads or (min(share, len(cores)) if cores else share)
                process = context.Process(target=_serve, name=f"folio-worker-{rank}", daemon=True,
                                          args=(config, rank, init_method, threads, cores, theirs))
                process.start()
                theirs.close()
                self.processes.append(process)
            self._gather()  # each worker reports once its model is loaded
        except BaseException:
            self.shutdown()
            raise
        self.started = True
        logger.info("%d tensor-parallel workers ready (%s, %d threads each)", ranks, init_method, threads)

    def shutdown(self) -> None:
        self._finalizer()

    def _call(self, method: str, *args: Any) -> Any:
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, connection in enumerate(self.connections):
            try:
                connection.send_bytes(message)
            except OSError:  # its end of the pipe is closed: the process is gone
                raise self._gone(rank) from None
        return self._gather()

    def _gather(self) -> Any:
        """Every rank's answer to the last call; rank 0's result. The first error (or death) of any rank is
        raised, and the workers are stopped: the others may be waiting in a collective for it."""
        results: dict[int, Any] = {}
        pending = dict(enumerate(self.connections))
        while pending:
            wait(list(pending.values()))  # a dead worker's pipe reads as its end
            for rank, connection in list(pending.items()):
                if not connection.poll():
                    continue
                try:
                    status, value = connection.recv()
                except EOFError:
                    raise self._gone(rank) from None
                del pending[rank]
                if status == "error":
                    self.shutdown()
                    if self.started and not isinstance(value, WorkerError):  # a ValueError in a step
                        raise WorkerError(f"tensor-parallel worker {rank} failed: {value!r}") from value
                    raise value
                results[rank] = value
        return results[0]

    def _gone(self, rank: int) -> WorkerError:
        self.shutdown()  # the others may be waiting for it in a collective
        return WorkerError(f"tensor-parallel worker {rank} exited (code {self.processes[rank].exitcode})")


def _serve(config: EngineConfig, rank: int, init_method: str, threads: int, cores: Optional[list[int]],
           connection: Connection) -> None:
    """A worker process's life: build the Worker, then answer calls until told to stop or the engine is gone."""
    from folio.distributed.parallel_state import destroy_tensor_parallel
    from folio.worker.worker import Worker

    try:
        worker = Worker(config, rank, init_method, threads, cores)
        connection.send(("ok", None))
    except BaseException as e:
        _send_error(connection, rank, e)
        return
    try:
        while True:
            try:
                method, args = pickle.loads(connection.recv_bytes())
            except EOFError:
                return
            if method == SHUTDOWN:
                return
            try:
                result = getattr(worker, method)(*args)
            except BaseException as e:
                _send_error(connection, rank, e)
                return
            connection.send(("ok", result if rank == 0 else None))
    finally:
        destroy_tensor_parallel()


def _send_error(connection: Connection, rank: int, error: BaseException) -> None:
    """The worker's exception as the engine will raise it: a ValueError (a bad option or model) as it is, to
    name what was wrong; anything else as a WorkerError carrying the worker's traceback."""
    if not isinstance(error, ValueError):
        error = WorkerError(f"tensor-parallel worker {rank} failed:\n{traceback.format_exc()}")
    try:
        connection.send(("error", error))
    except Exception:  # an exception that does not pickle: its text then
        connection.send(("error", WorkerError(f"tensor-parallel worker {rank} failed: {error!r}")))


def _stop(processes: list, connections: list[Connection], shm_path: str) -> None:
    message = pickle.dumps((SHUTDOWN, ()))
    for connection in connections:
        try:
            connection.send_bytes(message)
        except OSError:
            pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    for connection in connections:
        connection.close()
    shm_all_reduce.remove_buffer(shm_path)
