"""Tensor-parallel ranks as Ray actors (distributed_executor_backend "ray"): what the `mp` executor gives, over a
Ray instance the engine starts and stops itself, or one this process already runs."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from conftest import build_tiny_model  # noqa: E402
from folio import LLM, SamplingParams  # noqa: E402
from folio.executor.executor import WorkerError  # noqa: E402
from test_tensor_parallel import ENGINE, GREEDY, PROMPTS, _assert_same, _run  # noqa: E402

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


def test_an_engine_that_starts_ray_gives_one_ranks_tokens_and_stops_it(folder):
    assert not ray.is_initialized()
    llm = LLM(folder, **RAY, **ENGINE)
    try:
        two = [(out.outputs[0].token_ids, out.outputs[0].logprobs)
               for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()
    _assert_same(_run(folder, GREEDY, 1), two)


@pytest.fixture(scope="module")
def running_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_an_engine_on_a_running_ray_leaves_it_running(folder, running_ray):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    llm = LLM(folder, **RAY, **ENGINE)
    tokens = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], seeded)]
    llm.llm_engine.shutdown()
    assert ray.is_initialized()
    assert tokens == [t for t, _ in _run(folder, seeded, 1)]


def test_an_actors_value_error_reaches_the_caller(tmp_path, running_ray):
    folder = build_tiny_model(str(tmp_path), "qwen2", intermediate_size=127)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's intermediate_size"):
        LLM(folder, **RAY, **ENGINE)
    with pytest.raises(ValueError, match="Ray has 2 free CPUs, and each rank's actor takes one at least"):
        LLM(folder, **{**RAY, "tensor_parallel_size": 4}, **ENGINE)


def test_an_actor_that_dies_fails_the_engine(folder, running_ray):
    llm = LLM(folder, **RAY, **ENGINE)
    ray.kill(llm.llm_engine.executor.actors[1])
    with pytest.raises(WorkerError, match="Ray actor died"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)


def test_an_error_in_a_step_ends_the_engine(folder, running_ray):
    from folio.core.step_contract import ScheduledRequestData, SchedulerOutput

    llm = LLM(folder, **RAY, **ENGINE)
    with pytest.raises(WorkerError, match="(?s)Ray actor failed.*KeyError"):
        llm.llm_engine.executor.execute(SchedulerOutput(scheduled=[ScheduledRequestData("never-added", 0, 1)]))
    assert llm.llm_engine.executor.actors == []  # killed
