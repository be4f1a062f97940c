"""Backpressure and deadlines: a full waiting queue refuses with 503 and Retry-After (counted in /metrics), a request
past its deadline ends with a 504 and frees its blocks, a storm on a tiny KV cache loses nothing, and connections
that stall or crowd are cut off."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from folio.entrypoints.openai.server_options import ServerOptions
from server_fixture import MODEL_NAME, running_server
from test_server_errors import assert_error

LONG = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}


def slow_steps(monkeypatch, llm, seconds: float = 0.01) -> None:
    """Each engine step takes at least `seconds`, so that a request runs long enough to be caught running."""
    step = llm.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_a_full_waiting_queue_refuses_with_503_and_retry_after(llama_dir, monkeypatch):
    with running_server(llama_dir, max_num_seqs=1, options=ServerOptions(max_waiting_requests=1)) as server:
        slow_steps(monkeypatch, server.llm)
        with httpx.Client(base_url=server.base_url, timeout=30) as running_client, \
                httpx.Client(base_url=server.base_url, timeout=30) as waiting_client:
            with running_client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                chunks = running.iter_lines()  # kept: a closed iterator would close the stream, and abort it
                next(chunks)  # a first chunk: it is in the batch, the only seat
                with waiting_client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as waiting:
                    assert waiting.status_code == 200  # accepted, so queued: the queue is full now
                    refused = httpx.post(server.base_url + "/v1/completions", json=LONG, timeout=30)
                    assert_error(refused, 503, "overloaded")
                    assert refused.headers["retry-after"] == "1"
                    assert metric(server.base_url, "folio:requests_rejected_total") == 1
        server.wait_idle()


def test_a_request_past_its_deadline_ends_with_504_and_frees_its_blocks(llama_dir, monkeypatch):
    with running_server(llama_dir, max_num_seqs=1, options=ServerOptions(request_timeout=0.5)) as server:
        slow_steps(monkeypatch, server.llm)
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            started = time.monotonic()
            with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as streamed:
                lines = [line for line in streamed.iter_lines() if line]
            assert time.monotonic() - started < 10
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["code"] == 504 and "request timeout of 0.5 s" in error["message"]
            assert_error(client.post("/v1/completions", json=LONG), 504, "request timeout")
        server.wait_idle()


def test_a_storm_on_a_tiny_kv_cache_loses_no_request(llama_dir):
    """48 clients at once against 32 KV blocks and a waiting bound of 8: each gets its completion or a 503 with
    Retry-After, nothing else, and the cache is empty afterwards."""
    options = ServerOptions(max_waiting_requests=8, max_waiting_tokens=2000)
    with running_server(llama_dir, kv_cache_memory=1 << 18, block_size=16, max_model_len=256,
                        options=options) as server:
        assert server.llm.engine.kv_cache_manager.pool.num_blocks == 32

        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            body = {"model": MODEL_NAME, "prompt": f"{i} " + "once upon a time " * 20, "max_tokens": 40,
                    "ignore_eos": True, "stream": i % 2 == 0}
            return await client.post("/v1/completions", json=body)

        async def storm() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=48)) as client:
                return await asyncio.gather(*(one(client, i) for i in range(48)))

        responses = asyncio.run(storm())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503} and 200 in statuses, statuses
        for response in responses:
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
            elif response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in response.text
            else:
                assert response.json()["choices"][0]["finish_reason"] == "length"
        assert metric(server.base_url, "folio:requests_rejected_total") == statuses.count(503)
        server.wait_idle()


def _port(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def test_a_connection_that_does_not_finish_its_headers_is_closed(llama_dir):
    with running_server(llama_dir, options=ServerOptions(header_timeout=0.3)) as server:
        with socket.create_connection(_port(server), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            assert sock.recv(1024) == b""  # closed by the server (a timeout here would raise)
        assert httpx.get(server.base_url + "/health").status_code == 200


def test_connections_beyond_the_limit_get_503(llama_dir):
    with running_server(llama_dir, options=ServerOptions(max_connections=2)) as server:
        idle = [socket.create_connection(_port(server), timeout=10) for _ in range(2)]
        try:
            time.sleep(0.2)  # the server has taken them
            assert httpx.get(server.base_url + "/health").status_code == 503
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
