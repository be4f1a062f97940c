"""AsyncLLM: the engine for asyncio servers.

One LLMEngine runs its step loop in a background thread, so a forward pass never blocks the event loop.
The engine is touched by that thread only: callers send it commands (add, abort, shutdown) through a
thread-safe queue, and it hands each request's outputs back to the caller's event loop with
`call_soon_threadsafe`. Each submission gets a RequestStream; closing a stream before it has finished
(the client went away) aborts its requests, which frees their KV blocks at the next command drain.

Under load it refuses rather than queues without end (folio.engine.admission): a submission arriving while
the waiting queue is at its bound fails with EngineOverloadedError, and a request past its deadline is aborted
and fails with RequestTimeoutError. Whatever stops the engine thread, even a BaseException, fails every stream
still listening and every submission still queued, so that no caller waits for ever.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from typing import AsyncGenerator, Callable, Iterable, Optional, Protocol, Sequence, Union

from folio.config import EngineConfig
from folio.core.scheduler import SchedulerStats
from folio.engine.admission import AdmissionPolicy
from folio.engine.input_processor import Params, PromptType
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.engine.stats import IterationStats, StatsCollector
from folio.executor.executor import WorkerError
from folio.outputs import EngineOutput, RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger("folio")


class EngineError(RuntimeError):
    """A request failed inside the engine, through no fault of its input."""


class EngineDeadError(EngineError):
    """The engine is shut down, or stopped after an error it could not recover from."""


class EngineOverloadedError(EngineError):
    """The waiting queue is at its bound: the request was not queued, and may be sent again later."""


class RequestTimeoutError(EngineError):
    """The request ran past its deadline: it was aborted and its KV blocks freed."""


class StatLogger(Protocol):
    """Receives stats after every step, on the engine thread: it must be quick and thread-safe."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class RequestStream:
    """The outputs of the engine requests submitted together (one HTTP request), in the order the engine made them.

    Iterating yields RequestOutputs, or EmbeddingRequestOutputs for pooling requests (their request_id says
    which prompt); an engine failure is raised from the iteration. It ends once every request has finished.
    """

    def __init__(self, llm: "AsyncLLM", request_ids: list[str], deadline: Optional[float] = None) -> None:
        self.request_ids = request_ids
        self.deadline = deadline  # monotonic time at which the engine aborts what is unfinished
        self._llm = llm
        self._unfinished = set(request_ids)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Union[EngineOutput, BaseException, None]] = asyncio.Queue()

    def put(self, item: Union[EngineOutput, BaseException, None]) -> None:
        """Engine thread: hand over an output, an error, or None (= the requests were accepted)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    async def accepted(self) -> None:
        """Wait until the engine has validated and queued the requests; raises what add_request raised."""
        item = await self._queue.get()
        if item is not None:
            self._unfinished.clear()
            raise item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> EngineOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort whatever has not finished (the consumer is gone). Idempotent; safe from a finally block."""
        if self._unfinished:
            self._llm.abort(list(self._unfinished))
            self._unfinished.clear()


class AsyncLLM:
    """An LLMEngine driven by a background thread, with async per-request output streams."""

    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = (),
                 admission: AdmissionPolicy = AdmissionPolicy()) -> None:
        self.engine = engine
        self.admission = admission
        # Appended to by servers before they take requests; read by the engine thread after each step.
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.scheduler_stats: SchedulerStats = engine.get_stats()  # snapshot after the latest step
        self.dead: Optional[BaseException] = None  # set when the engine can no longer run steps
        self._accepting = True
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Held while submitting a command and while the engine thread closes the queue, so that nothing is put
        # after its last drain. Re-entrant: a signal handler may call begin_shutdown on a thread that holds it.
        self._commands_lock = threading.RLock()
        self._commands_closed = False
        # Engine thread only:
        self._streams: dict[str, RequestStream] = {}
        self._stats = StatsCollector()
        self._deadline: Optional[float] = None  # set by shutdown: abort what is still running at this time
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, stat_loggers: Sequence[StatLogger] = (),
                    admission: AdmissionPolicy = AdmissionPolicy()) -> "AsyncLLM":
        return cls(LLMEngine(config), stat_loggers, admission)

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        """Healthy and not shutting down: new requests are taken."""
        return self._accepting and self.is_healthy

    # ---- caller side (any thread for abort/shutdown; an event loop for the rest) -----------------------

    async def add_requests(self, prompts: Sequence[tuple[str, PromptType]], params: Optional[Params] = None,
                           priority: int = 0, output_kind: OutputKind = OutputKind.DELTA) -> RequestStream:
        """Submit (request_id, prompt) pairs sharing params; all are accepted or none (ValueError naming the field).

        output_kind: DELTA (each output holds only what is new) or FINAL_ONLY.
        """
        if output_kind == OutputKind.CUMULATIVE:
            raise ValueError("AsyncLLM streams DELTA or FINAL_ONLY outputs")
        if not self._accepting or not self.is_healthy:
            raise EngineDeadError("the engine is shut down" if not self._accepting else f"the engine died: {self.dead!r}")
        arrival_time = time.monotonic()
        stream = RequestStream(self, [rid for rid, _ in prompts], self.admission.deadline(arrival_time))
        self._submit(functools.partial(self._add, stream, list(prompts), params, priority, arrival_time, output_kind))
        try:
            await stream.accepted()
        except BaseException:
            stream.close()  # cancelled while waiting: abort what the engine may have queued meanwhile
            raise
        return stream

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0,
                       output_kind: OutputKind = OutputKind.DELTA) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request. Leaving the loop early aborts it (at once if the generator is closed, e.g.
        with contextlib.aclosing; else when it is garbage-collected)."""
        request_id = request_id if request_id is not None else self.engine.next_request_id()
        stream = await self.add_requests([(request_id, prompt)], params, priority, output_kind)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (thread-safe, returns at once); streams still listening get a final "abort" output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            self._submit(functools.partial(self._abort, ids))
        except EngineDeadError:
            pass  # the engine thread has ended, and with it every request

    def begin_shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting now; requests running get `timeout` seconds to finish, then end with finish_reason
        "abort", and the engine thread ends. Returns at once (a signal handler may call it)."""
        self._accepting = False
        try:
            self._submit(functools.partial(self._begin_shutdown, time.monotonic() + timeout))
        except EngineDeadError:
            pass  # already ended

    def shutdown(self, timeout: float = 0.0) -> None:
        """begin_shutdown, then wait for the engine thread to end."""
        self.begin_shutdown(timeout)
        self._thread.join()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._commands_lock:
            if self._commands_closed:
                raise EngineDeadError("the engine is shut down" if self.dead is None else
                                      f"the engine died: {self.dead!r}")
            self._commands.put(command)

    # ---- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # KeyboardInterrupt, SystemExit or the like: no step can be trusted now
            logger.exception("the engine thread stopped")
            self.dead = e
        try:
            if self.dead is None:
                self._abort(list(self._streams))  # listeners get a final output with finish_reason "abort"
        except Exception:
            logger.exception("aborting the requests left at shutdown failed")
        self._fail_all(EngineDeadError("the engine is shut down" if self.dead is None else
                                       f"the engine died: {self.dead!r}"))
        with self._commands_lock:
            self._commands_closed = True
        self._run_commands(block=False)  # answer submissions that raced with the end
        self.engine.shutdown()  # its worker processes, if any

    def _serve(self) -> None:
        while self.dead is None:
            idle = not self.engine.has_unfinished_requests()
            if self._deadline is not None and (idle or time.monotonic() >= self._deadline):
                return
            try:
                self._run_commands(block=idle and self._deadline is None)
                self._expire()
                if self.dead is None and self.engine.has_unfinished_requests():
                    self._step()
            except WorkerError as e:  # a worker process is gone: no later step can run
                logger.error("%s; the engine stops", e)
                self.dead = e
            except Exception as e:
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineError(f"the engine failed while running this request: {e!r}"))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                command()
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _add(self, stream: RequestStream, prompts: list[tuple[str, PromptType]], params: Optional[Params],
             priority: int, arrival_time: float, output_kind: OutputKind) -> None:
        if self.dead is not None or self._deadline is not None:
            stream.put(EngineDeadError("the engine is not accepting requests"))
            return
        refusal = self.admission.refusal(self.engine.scheduler.waiting)
        if refusal is not None:
            stream.put(EngineOverloadedError(f"the server is overloaded: {refusal}; retry later"))
            return
        added: list[str] = []
        try:
            for request_id, prompt in prompts:
                self.engine.add_request(request_id, prompt, params, priority, arrival_time, output_kind)
                added.append(request_id)
        except Exception as e:
            stream.put(e)
            self.engine.abort_request(added)  # one bad prompt rejects the whole submission
            return
        for request_id in added:
            self._streams[request_id] = stream
        stream.put(None)

    def _abort(self, request_ids: list[str]) -> None:
        outputs = self.engine.abort_request(request_ids)
        self._record(outputs)
        self._deliver(outputs)
        for request_id in request_ids:
            self._streams.pop(request_id, None)

    def _begin_shutdown(self, deadline: float) -> None:
        self._deadline = deadline

    def _expire(self) -> None:
        """Abort the requests of every stream past its deadline; the stream fails with RequestTimeoutError."""
        if self.admission.request_timeout is None:
            return
        now = time.monotonic()
        for stream in {s for s in self._streams.values() if s.deadline is not None and s.deadline <= now}:
            request_ids = [rid for rid in stream.request_ids if rid in self._streams]
            self._record(self.engine.abort_request(request_ids))
            for request_id in request_ids:
                del self._streams[request_id]
            stream.put(RequestTimeoutError(f"the request did not finish within the server's request timeout of "
                                           f"{self.admission.request_timeout:g} s; it was aborted"))

    def _step(self) -> None:
        outputs = self.engine.step()
        self._record(outputs)  # before delivery: a client that has its answer finds it in the metrics too
        self._deliver(outputs)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _record(self, outputs: list[EngineOutput]) -> None:
        scheduler_stats = self.engine.get_stats()
        iteration = self._stats.record(outputs)
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration)
        self.scheduler_stats = scheduler_stats  # published last: a state seen here is in every logger too

    def _fail_all(self, error: EngineError) -> None:
        """Fail every request in flight and free it; if even that fails, the engine cannot go on: dead."""
        streams, self._streams = self._streams, {}
        if streams and self.dead is None:
            try:
                self._record(self.engine.abort_request(list(streams)))
            except Exception as e:
                logger.exception("could not abort the failed requests; the engine stops serving")
                self.dead = e
        for stream in set(streams.values()):
            stream.put(error)
