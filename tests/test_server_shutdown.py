"""How the server stops: at the shutdown deadline streams end with finish_reason "abort" and [DONE], and the exit
status is 0; an engine that dies (even of a BaseException) fails its streams and the exit status is 1."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time

import httpx
import pytest

from folio.engine.async_llm import EngineDeadError
from folio.entrypoints.openai.server_options import ServerOptions
from server_fixture import MODEL_NAME, running_server
from test_server_backpressure import LONG, slow_steps


def stream_in_background(base_url: str) -> tuple[threading.Event, list[str], threading.Thread]:
    """A long completion streamed by a thread: (set at the first chunk, its data lines, the thread)."""
    first_chunk, lines = threading.Event(), []

    def read() -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    first_chunk.set()

    thread = threading.Thread(target=read)
    thread.start()
    return first_chunk, lines, thread


def test_at_the_shutdown_deadline_streams_end_with_abort_and_done(llama_dir, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    with running_server(llama_dir, options=ServerOptions(shutdown_timeout=0.3)) as server:
        slow_steps(monkeypatch, server.llm)
        first_chunk, lines, reader = stream_in_background(server.base_url)
        assert first_chunk.wait(20)
        server.server.handle_exit(signal.SIGTERM, None)  # what the signal does
        assert not server.llm.is_accepting  # at once, before any deadline
        with pytest.raises(EngineDeadError):
            asyncio.run(server.llm.add_requests([("late", "hi")]))
        reader.join(20)
        server.thread.join(20)
        assert server.exit_status == 0
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "abort"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "Cancel" in r.getMessage()]


@pytest.mark.parametrize("exit_on_engine_death", [True, False])
def test_an_engine_thread_that_dies_fails_its_streams(llama_dir, monkeypatch, exit_on_engine_death):
    """A BaseException on the engine thread (here SystemExit from a step): the stream in flight gets an error and
    [DONE] instead of waiting for ever; the server exits with status 1, or keeps answering 503 when told to."""
    with running_server(llama_dir, options=ServerOptions(exit_on_engine_death=exit_on_engine_death)) as server:
        slow_steps(monkeypatch, server.llm)
        first_chunk, lines, reader = stream_in_background(server.base_url)
        assert first_chunk.wait(20)

        def dying_step():
            raise SystemExit("injected")

        monkeypatch.setattr(server.llm.engine, "step", dying_step)
        reader.join(20)
        assert not reader.is_alive() and lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == 503 and "the engine died" in error["message"]
        if exit_on_engine_death:
            server.thread.join(20)
            assert server.exit_status == 1
        else:
            time.sleep(0.3)  # several of uvicorn's ticks
            assert server.thread.is_alive()
            assert httpx.get(server.base_url + "/health").status_code == 503
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
            assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 503
