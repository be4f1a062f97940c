"""A real folio server (uvicorn on 127.0.0.1, a free port) in a background thread, for the server tests."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx
import openai

from folio.config import EngineConfig
from folio.engine.async_llm import AsyncLLM
from folio.entrypoints.openai.server import FolioServer, bind_socket, create_app
from folio.entrypoints.openai.server_options import ServerOptions

MODEL_NAME = "tiny-llama"
ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory=1 << 22, num_threads=1)


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    llm: AsyncLLM
    server: FolioServer
    thread: threading.Thread
    api_key: Optional[str] = None
    exit_status: Optional[int] = None  # serve_until_stopped()'s, once the server has stopped

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> None:
        wait_idle(self.llm, timeout)


def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait for the engine thread to free everything: no request in the scheduler, every KV block free, and the
    stats published (after the stat loggers ran, so metrics are current too)."""
    engine = llm.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.scheduler_stats
        if (engine.scheduler.num_unfinished == 0 and not engine.output_processor.states
                and engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_blocks
                and stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0):
            return
        time.sleep(0.005)
    raise AssertionError(f"engine not idle: {engine.scheduler.num_unfinished} requests, "
                         f"{engine.kv_cache_manager.num_free_blocks}/{engine.kv_cache_manager.pool.num_blocks} blocks free")


@contextlib.contextmanager
def running_server(model_dir: str, api_key: Optional[str] = None, max_body_bytes: Optional[int] = None,
                   options: ServerOptions = ServerOptions(), **engine_kwargs) -> Iterator[RunningServer]:
    """`folio serve`'s server in a thread (which gets no signals); it stops when the test ends."""
    llm = AsyncLLM.from_config(EngineConfig.from_kwargs(model=model_dir, **{**ENGINE_KWARGS, **engine_kwargs}),
                               admission=options.admission())
    app = create_app(llm, MODEL_NAME, api_key, options=options,
                     **({"max_body_bytes": max_body_bytes} if max_body_bytes else {}))
    sock = bind_socket("127.0.0.1", 0)
    server = FolioServer(llm, app, options)

    def run() -> None:
        running.exit_status = server.serve_until_stopped(sock)

    running = RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", llm, server,
                            threading.Thread(target=run, daemon=True), api_key)
    running.thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert running.thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield running
    finally:
        server.should_exit = True
        running.thread.join(timeout=10)
