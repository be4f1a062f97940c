"""A soak: hundreds of streams at concurrency 16, a third of them left mid-stream by their clients. No request is
lost, the engine ends idle with every KV block free, and resident memory stays flat after a warm-up.

The bound on memory is generous for a test sharing its process with the client and with pytest: 16 MiB over
240 requests. Measured: about 1 MiB per 600 requests on this tiny model in-process, and 0.1 to 0.2 MiB per 600
for `folio serve` of the embedded SmolLM2 (tests/soak.py, rounds of 600 at concurrency 32)."""

from __future__ import annotations

import gc

import psutil

from server_fixture import running_server
from soak import check_soak

MEMORY_BOUND_MIB = 16


def resident_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_streams_with_random_disconnects_lose_nothing_and_leak_nothing(llama_dir):
    with running_server(llama_dir) as server:
        # Warm-up: caches, pools, first allocations. The allocator's own growth in the first few hundred requests
        # varies by 6 to 15 MiB from run to run (measured, 2026-12-07); after 240 it is flat within 1-2 MiB a round.
        check_soak(server, num_requests=240, concurrency=16, seed=0)
        before = resident_mib()
        result = check_soak(server, num_requests=240, concurrency=16, seed=1)
        growth = resident_mib() - before
        assert result.outcomes["finished"] > 80 and result.outcomes["disconnected"] > 40, result.outcomes
        assert growth < MEMORY_BOUND_MIB, f"resident memory grew by {growth:.1f} MiB over 240 requests"
