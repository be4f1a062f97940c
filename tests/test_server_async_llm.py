"""AsyncLLM: streams, aborts, errors from add_request and from the engine thread, shutdown, stats."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from folio import LLM, SamplingParams
from folio.config import EngineConfig
from folio.engine.async_llm import AsyncLLM, EngineDeadError, EngineError
from folio.engine.output_processor import OutputKind
from server_fixture import ENGINE_KWARGS, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=llama_dir, **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


async def collect(llm: AsyncLLM, prompt, params, **kwargs) -> list:
    return [out async for out in llm.generate(prompt, params, **kwargs)]


def test_deltas_join_to_the_offline_result(llm, llama_dir):
    prompts = ["Once upon a time", "hello world", "def add(a, b):"]

    async def run():
        return await asyncio.gather(*(collect(llm, p, GREEDY) for p in prompts))

    streamed = asyncio.run(run())
    offline = LLM(llama_dir, **ENGINE_KWARGS).generate(prompts, GREEDY, use_tqdm=False)
    for outs, ref in zip(streamed, offline):
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
        assert sum((o.outputs[0].token_ids for o in outs), []) == ref.outputs[0].token_ids
    wait_idle(llm)


def test_final_only_and_n(llm):
    outs = asyncio.run(collect(llm, "hello", SamplingParams(n=3, max_tokens=5, seed=1, ignore_eos=True),
                               output_kind=OutputKind.FINAL_ONLY))
    assert len(outs) == 1 and outs[0].finished and [len(c.token_ids) for c in outs[0].outputs] == [5, 5, 5]


def test_add_request_errors_surface_as_value_error(llm):
    async def run(prompt, params):
        async for _ in llm.generate(prompt, params):
            pass

    with pytest.raises(ValueError, match="logprobs"):
        asyncio.run(run("hi", SamplingParams(logprobs=50)))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(run("", GREEDY))

    async def two_at_once():  # one bad prompt rejects the submission and leaves nothing behind
        await llm.add_requests([("ok", "hello"), ("bad", {"prompt_token_ids": [99999]})], GREEDY)

    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(two_at_once())
    wait_idle(llm)


class Recorder:
    """A stat logger that keeps what it is told."""

    def __init__(self):
        self.tokens = 0
        self.finished = []

    def record(self, scheduler_stats, iteration_stats):
        self.tokens += iteration_stats.num_generation_tokens
        self.finished += iteration_stats.finished


@pytest.fixture
def recorder(llm):
    recorder = Recorder()
    llm.stat_loggers.append(recorder)
    yield recorder
    llm.stat_loggers.remove(recorder)


def test_leaving_the_loop_aborts_and_frees_blocks(llm, recorder):
    async def run():
        async with contextlib.aclosing(llm.generate("a long one", LONG)) as outputs:
            async for out in outputs:
                if len(out.outputs[0].token_ids):
                    break

    asyncio.run(run())
    wait_idle(llm)
    assert [f.finish_reasons for f in recorder.finished] == [["abort"]] and recorder.tokens < 400


def test_abort_ends_a_listening_stream(llm):
    async def run():
        seen = []
        async for out in llm.generate("to be aborted", LONG, request_id="victim"):
            seen.append(out)
            if len(seen) == 3:
                llm.abort("victim")
        return seen

    seen = asyncio.run(run())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in seen) < 400
    wait_idle(llm)


def test_engine_failure_fails_requests_and_engine_recovers(llm):
    engine = llm.engine
    original = engine.step

    def failing_step():
        engine.step = original  # fail once
        raise RuntimeError("boom")

    async def run():
        gen = llm.generate("doomed", GREEDY)
        engine.step = failing_step
        with pytest.raises(EngineError, match="boom"):
            async for _ in gen:
                pass
        return await collect(llm, "after", GREEDY)

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == "length" and llm.is_healthy
    wait_idle(llm)


def test_dead_engine_refuses_requests(llama_dir):
    llm = AsyncLLM.from_config(EngineConfig.from_kwargs(model=llama_dir, **ENGINE_KWARGS))
    engine = llm.engine

    def broken(*args, **kwargs):
        raise RuntimeError("corrupt")

    async def run():
        engine.step = engine.abort_request = broken  # a failure that cannot even be cleaned up
        with pytest.raises(EngineError):
            await collect(llm, "x", GREEDY)
        assert not llm.is_healthy
        with pytest.raises(EngineDeadError):
            await collect(llm, "y", GREEDY)

    asyncio.run(run())
    llm.shutdown()


@pytest.mark.parametrize("grace,finish", [(0.0, "abort"), (30.0, "length")])
def test_shutdown_aborts_or_finishes_in_flight_and_refuses_new(llama_dir, grace, finish):
    llm = AsyncLLM.from_config(EngineConfig.from_kwargs(model=llama_dir, **ENGINE_KWARGS))

    async def run():
        outputs = []
        first = asyncio.Event()

        async def consume():
            async for out in llm.generate("long", LONG):
                outputs.append(out)
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        start = time.monotonic()
        await asyncio.to_thread(llm.shutdown, grace)
        with pytest.raises(EngineDeadError):
            await collect(llm, "late", GREEDY)
        await task
        return outputs, time.monotonic() - start

    outputs, took = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == finish
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == 400 if finish == "length" else tokens < 400
    assert took < 20 and not llm._thread.is_alive()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.pool.num_blocks


def test_stat_loggers_see_every_step(llm, recorder):
    asyncio.run(collect(llm, "count me", GREEDY))
    wait_idle(llm)
    assert recorder.tokens == 12 and len(recorder.finished) == 1
    stats = recorder.finished[0]
    assert stats.finish_reasons == ["length"] and stats.num_generation_tokens == 12
    assert stats.e2e_latency >= (stats.queue_time or 0) >= 0
    assert llm.scheduler_stats.num_running == 0
