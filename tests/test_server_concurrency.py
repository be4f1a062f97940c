"""Many concurrent streaming clients, some leaving mid-stream; /metrics counters move with what was served."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixture import MODEL_NAME, running_server

FAMILIES = ["folio:num_requests_running", "folio:num_requests_waiting", "folio:kv_cache_usage_perc",
            "folio:prompt_tokens", "folio:generation_tokens", "folio:request_success", "folio:num_preemptions",
            "folio:prefix_cache_queries", "folio:prefix_cache_hits",
            "folio:time_to_first_token_seconds", "folio:inter_token_latency_seconds",
            "folio:e2e_request_latency_seconds", "folio:request_queue_time_seconds"]


@pytest.fixture(scope="module")
def server(llama_dir):
    # a small KV cache: 12 long requests do not all fit, so some are preempted and recomputed
    with running_server(llama_dir, kv_cache_memory=24 * 16 * 512, max_num_seqs=8) as s:
        yield s


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels without model_name): value}, checking each carries model_name."""
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL_NAME
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_endpoint_has_every_family_and_no_redirect(server):
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert set(FAMILIES) <= names
    samples = metrics(server)
    for reason in ("stop", "length", "abort"):
        assert ("folio:request_success_total", (("finished_reason", reason),)) in samples


def test_counters_move_with_requests(server):
    before = metrics(server)
    with server.http() as http:
        bodies = [http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": p, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True}).json()
                  for p in ("hello there", "the quick brown fox")]
    server.wait_idle()
    after = metrics(server)

    def delta(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    assert delta("folio:prompt_tokens_total") == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta("folio:generation_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies) == 12
    assert delta("folio:request_success_total", ("finished_reason", "length")) == 2
    assert delta("folio:request_success_total", ("finished_reason", "abort")) == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"folio:{name}_count") == 2
        assert delta(f"folio:{name}_sum") > 0
    assert delta("folio:inter_token_latency_seconds_count") == 10  # 5 gaps between 6 tokens, per request
    assert after[("folio:num_requests_running", ())] == 0 and after[("folio:kv_cache_usage_perc", ())] == 0


async def _stream(client: httpx.AsyncClient, i: int, leave_after: int | None) -> tuple[int, str | None, int]:
    """One streaming client; leave_after: chunks to read before hanging up (None = read to the end)."""
    body = {"model": MODEL_NAME, "prompt": f"client {i} says", "max_tokens": 120, "temperature": 1.0, "seed": i,
            "ignore_eos": True, "stream": True}
    chunks, finish = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            if leave_after is not None and chunks >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return i, finish, chunks


def test_concurrent_streams_with_disconnects_free_everything(server):
    before = metrics(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*(_stream(client, i, 3 if i % 3 == 0 else None) for i in range(12)))

    results = asyncio.run(run())
    server.wait_idle()
    finished = [r for r in results if r[0] % 3]
    assert all(finish == "length" for _, finish, _ in finished)
    assert all(chunks == 3 for i, _, chunks in results if i % 3 == 0)
    after = metrics(server)
    aborted = after[("folio:request_success_total", (("finished_reason", "abort"),))] - before.get(
        ("folio:request_success_total", (("finished_reason", "abort"),)), 0)
    assert aborted == 4  # the clients that hung up
    assert after[("folio:num_preemptions_total", ())] > before.get(("folio:num_preemptions_total", ()), 0)
    assert after[("folio:num_requests_running", ())] == after[("folio:num_requests_waiting", ())] == 0


def test_non_streaming_client_gone_aborts(server):
    """A client that stops waiting for a non-streamed answer gets its requests aborted too."""
    before = metrics(server)
    # 4 prompts x 4 samples x 350 tokens, in a cache that holds about one of them at a time: seconds of work
    body = {"model": MODEL_NAME, "prompt": ["a", "b", "c", "d"], "n": 4, "max_tokens": 350, "ignore_eos": True}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    server.wait_idle()
    after = metrics(server)
    key = ("folio:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) > 0
    assert after[("folio:generation_tokens_total", ())] - before[("folio:generation_tokens_total", ())] < 16 * 350
    assert time.monotonic() - start < 10
