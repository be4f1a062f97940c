"""A soak of streams against a running server: many concurrent clients, some of which go away mid-stream.

Shared by the soak test and by a manual measurement of resident memory over longer runs:
    PYTHONPATH=.:tests python tests/soak.py --rounds 6 --requests 600 [-- folio serve arguments]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil

from server_fixture import MODEL_NAME, RunningServer


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)  # "finished" | "disconnected" -> count


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int, result: SoakResult) -> None:
    chat = i % 2 == 0
    body = {"model": MODEL_NAME, "max_tokens": rng.randint(4, 24), "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: " + "tell me a story " * rng.randint(1, 8)}]
    else:
        body["prompt"] = f"request {i}: " + "once upon a time " * rng.randint(1, 8)
    disconnect_after = rng.randint(1, 3) if rng.random() < 0.33 else None
    async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        chunks, buffered = 0, ""
        async for text in response.aiter_text():  # events split on blank lines only: text may hold U+2028
            buffered += text
            *events, buffered = buffered.split("\n\n")
            for event in events:
                if event == "data: [DONE]":
                    result.outcomes["finished"] += 1
                    return
                json.loads(event.removeprefix("data: "))
                chunks += 1
                if chunks == disconnect_after:
                    result.outcomes["disconnected"] += 1
                    return  # leaving the block closes the connection mid-stream
    raise AssertionError(f"request {i}: the stream ended without [DONE]")


async def soak(base_url: str, num_requests: int, concurrency: int, seed: int) -> SoakResult:
    rng, result = random.Random(seed), SoakResult()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        async def bounded(i: int) -> None:
            async with gate:
                await _one(client, rng, i, result)

        await asyncio.gather(*(bounded(i) for i in range(num_requests)))
    return result


def main() -> None:
    """Serve a model with `folio serve` in a subprocess and print its resident memory after each round."""
    import re
    import subprocess
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("serve_args", nargs="*", help="more `folio serve` arguments (default: the embedded model)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "folio", "serve", "--port", "0", "--served-model-name", MODEL_NAME,
               *args.serve_args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        try:
            base_url = re.search(r"http://\S+?(?=/v1)", proc.stdout.readline()).group(0)
            server = psutil.Process(proc.pid)
            for round_ in range(args.rounds):
                outcomes = asyncio.run(soak(base_url, args.requests, args.concurrency, seed=round_)).outcomes
                print(f"round {round_}: {dict(outcomes)}, server resident {server.memory_info().rss / 2**20:.1f} MiB",
                      flush=True)
        finally:
            proc.terminate()


def check_soak(server: RunningServer, num_requests: int, concurrency: int, seed: int) -> SoakResult:
    result = asyncio.run(soak(server.base_url, num_requests, concurrency, seed))
    assert sum(result.outcomes.values()) == num_requests  # every request finished or was left by its client
    server.wait_idle()  # nothing left in the engine, every KV block free
    return result


if __name__ == "__main__":
    main()
