"""Serving benchmark: drives an OpenAI-compatible server on this machine (folio, vLLM, llama.cpp, ...) with
streaming requests and measures what a client sees, in the terms of vLLM's `bench serve`:

  TTFT  time to first token: request sent -> first chunk with text
  TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1), per request
  ITL   inter-token latency: the gap between consecutive text chunks
  E2E   request sent -> last byte

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Output lengths are fixed with `ignore_eos` (a vLLM extension that folio honours; a
server that does not may stop early, which the output token counts show). Token counts come from the stream's
usage chunk. Only loopback addresses are accepted: the benchmark is for the machine it runs on.

    folio serve MODEL &
    folio bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4 --result-file r.json
    folio bench serve --endpoint chat --dataset chat --max-concurrency 8 --plot latency.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import random
import time
import urllib.parse
from typing import Any

import httpx

from folio import envs
from folio.bench.plot import plot_serve
from folio.bench.report import summarize, write_json
from folio.bench.serve_result import RequestRecord, ServeResult
from folio.bench.workload import BenchRequest, add_workload_arguments, client_requests, describe

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, without /v1 (default: http://127.0.0.1:8000); loopback only")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                        help="completions (/v1/completions) or chat (/v1/chat/completions; needs a chat dataset) "
                             "(default: completions)")
    parser.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", default=envs.api_key(),
                        help="sent as 'Authorization: Bearer KEY' (default: $FOLIO_API_KEY, else none)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean requests/s of Poisson arrivals; inf sends all at once (default: inf)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    parser.add_argument("--vocab-size", type=int, default=10000,
                        help="random prompts draw token ids below this; keep it within the served model's "
                             "vocabulary (default: 10000)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the whole benchmark may take; requests still running then are cancelled "
                             "and counted as failed (default: 1800)")
    parser.add_argument("--result-file", metavar="FILE", help="write the result, every request included, as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw latency and throughput charts to this PNG "
                                                      "(needs matplotlib)")
    add_workload_arguments(parser)


def check_loopback(base_url: str) -> None:
    """Refuse anything but this machine: the benchmark floods its target with requests."""
    host = urllib.parse.urlsplit(base_url).hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--base-url must be a loopback address (127.0.0.1, ::1, localhost), got {base_url!r}")


def _body(request: BenchRequest, args: argparse.Namespace, model: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = request.chat_messages
    else:
        body["prompt"] = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt_text
    return body


def _chunk_text(choice: dict) -> str:
    """Text a streamed choice carries, for completions ('text') and chat ('delta.content') alike; a reasoning
    model's reasoning ('delta.reasoning', or 'delta.reasoning_content' from older servers) is output too."""
    delta = choice.get("delta") or {}
    return choice.get("text") or delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or ""


async def _send(client: httpx.AsyncClient, path: str, body: dict, record: RequestRecord) -> None:
    """Stream one request, filling in record as chunks arrive (so a cancelled request keeps what it got)."""
    start = last = time.perf_counter()
    chunks = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            record.error = f"HTTP {response.status_code}: {text[:300]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = str(chunk["error"])
                return
            if chunk.get("usage"):
                record.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                record.output_tokens = chunk["usage"].get("completion_tokens", 0)
            if any(_chunk_text(c) for c in chunk.get("choices") or ()):
                now = time.perf_counter()
                if record.ttft_s is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
                chunks += 1
    record.latency_s = time.perf_counter() - start
    record.output_tokens = record.output_tokens or chunks  # a server without usage chunks: one token per chunk


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("the server lists no models; pass --model")
    return models[0]["id"]


async def _drive(args: argparse.Namespace, requests: list[BenchRequest]) -> ServeResult:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # no proxies from the environment, and no pool limit that would queue requests inside the client
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits,
                                 trust_env=False) as client:
        path = ENDPOINTS[args.endpoint]
        probe = RequestRecord(0.0)  # one short request first: fail fast, with the server's own message
        try:
            model = args.model or await _served_model(client)
            await asyncio.wait_for(_send(client, path, _body(requests[0], args, model, 2), probe), args.timeout)
        except (httpx.HTTPError, TimeoutError) as e:
            raise ValueError(f"cannot benchmark {args.base_url}: {type(e).__name__}: {e}") from e
        if not probe.ok:
            raise ValueError(f"the first test request failed: {probe.error or 'no tokens came back'}")

        rng = random.Random(args.dataset_seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        start = time.perf_counter()
        deadline = start + args.timeout
        records: list[RequestRecord] = []
        tasks = []

        async def run(request: BenchRequest, record: RequestRecord) -> None:
            async with limit:
                record.start_s = time.perf_counter() - start
                try:
                    await asyncio.wait_for(_send(client, path, _body(request, args, model, request.output_len),
                                                 record), max(0.0, deadline - time.perf_counter()))
                except TimeoutError:
                    record.error = f"cancelled by --timeout {args.timeout:g} s"
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    record.error = f"{type(e).__name__}: {e}"

        for i, request in enumerate(requests):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            record = RequestRecord(time.perf_counter() - start)
            records.append(record)
            if time.perf_counter() >= deadline:
                record.error = f"not sent: --timeout {args.timeout:g} s passed"
                continue
            tasks.append(asyncio.create_task(run(request, record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _result(args, model, records, duration)


def _result(args: argparse.Namespace, model: str, records: list[RequestRecord], duration: float) -> ServeResult:
    done = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return ServeResult(
        base_url=args.base_url, endpoint=args.endpoint, model=model, workload=describe(args),
        request_rate=args.request_rate if math.isfinite(args.request_rate) else None,
        max_concurrency=args.max_concurrency, num_prompts=len(records), completed=len(done),
        failed=len(records) - len(done), duration_s=duration, request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration, total_token_throughput=(prompt_tokens + output_tokens) / duration,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        ttft=summarize([r.ttft_s for r in done]),
        tpot=summarize([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        itl=summarize([gap for r in done for gap in r.itl_s]),
        e2e_latency=summarize([r.latency_s for r in done]), requests=records)


def print_result(result: ServeResult) -> None:
    rate = "inf" if result.request_rate is None else f"{result.request_rate:g}/s"
    print(f"folio bench serve: {result.base_url}{ENDPOINTS[result.endpoint]}, model {result.model}, "
          f"{result.workload}, request rate {rate}, max concurrency {result.max_concurrency or 'none'}")
    print(f"  completed {result.completed}/{result.num_prompts} (failed {result.failed}) in {result.duration_s:.2f} s; "
          f"{result.prompt_tokens} prompt + {result.output_tokens} output tokens")
    print(f"  throughput: {result.request_throughput:.2f} requests/s, {result.output_throughput:.1f} output tokens/s, "
          f"{result.total_token_throughput:.1f} total tokens/s")
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        summary = getattr(result, name)
        label = name.split("_")[0].upper()
        print(f"  {label:<5}{summary.line(1e3, 'ms') if summary else 'no data'}")
    errors = [r.error for r in result.requests if r.error]
    if errors:
        print(f"  first error: {errors[0]}")


def main(args: argparse.Namespace) -> int:
    check_loopback(args.base_url)
    if args.endpoint == "chat" and args.dataset == "random":
        raise ValueError("--endpoint chat needs conversations: pass --dataset chat (or a .jsonl file)")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate must be > 0 and --max-concurrency >= 1")
    requests = client_requests(args, args.vocab_size)
    result = asyncio.run(_drive(args, requests))
    print_result(result)
    if args.result_file:
        write_json(args.result_file, result)
    if args.plot:
        plot_serve(result, args.plot)
    return 0 if result.completed else 1
