"""The step contract: the model runner works from the scheduler's messages alone.

A model runner in another process receives each SchedulerOutput as pickled bytes and answers with a pickled
ModelRunnerOutput, as a worker process would; the engine driving it must give exactly the outputs of the
engine with its runner in-process, through chunked prefill, preemption and resumption, seeded sampling,
penalties, min_tokens, logprobs and prompt logprobs, and pooled embeddings.
"""

from __future__ import annotations

import multiprocessing
import pickle

import pytest

from folio import LLM, PoolingParams, SamplingParams
from folio.core.step_contract import (ModelRunnerOutput, NewRequestData, SampledLogprobs, SampledTokens,
                                      ScheduledRequestData, SchedulerOutput)

# Small blocks, a small step budget and a KV cache of 24 blocks: prompts are chunked and requests preempted.
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=96,
              kv_cache_memory=24 * 2 * 2 * 2 * 16 * 4 * 4)

PARAMS = [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, n=2),
    SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=18, repetition_penalty=1.3,
                   frequency_penalty=0.4, logprobs=1),
    SamplingParams(temperature=0, max_tokens=16, min_tokens=10, presence_penalty=0.5, logit_bias={7: 2.0}),
    SamplingParams(temperature=1.0, seed=3, max_tokens=22, min_p=0.05),
]
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(14 + 5 * i)]} for i in range(len(PARAMS))]


def _serve_runner(conn, model_dir: str) -> None:
    """A worker process: builds a model runner the way an engine does, then executes pickled messages."""
    from folio.engine.llm_engine import LLMEngine

    runner = LLMEngine.from_kwargs(model_dir, **ENGINE).runner
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        conn.send_bytes(pickle.dumps(runner.execute(pickle.loads(message))))


def _summary(outputs) -> list:
    def logprobs(entries):
        return None if entries is None else [None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()}
                                             for e in entries]

    return [[(c.token_ids, c.finish_reason, logprobs(c.logprobs)) for c in o.outputs] + [logprobs(o.prompt_logprobs)]
            for o in outputs]


def _embeddings(llm: LLM) -> list:
    return [[o.outputs.embedding for o in llm.embed(PROMPTS, PoolingParams(pooling), use_tqdm=False)]
            for pooling in ("last", "mean")]


def test_runner_in_another_process_gives_the_same_outputs(llama_dir):
    local = LLM(llama_dir, **ENGINE)
    expected = _summary(local.generate(PROMPTS, PARAMS, use_tqdm=False))
    expected_embeddings = _embeddings(local)
    assert local.llm_engine.scheduler.num_preemptions > 0, "the workload should preempt"

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    worker = context.Process(target=_serve_runner, args=(child, llama_dir), daemon=True)
    worker.start()
    messages = []

    def remote_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        parent.send_bytes(pickle.dumps(scheduler_output))
        messages.append(scheduler_output)
        return pickle.loads(parent.recv_bytes())

    try:
        llm = LLM(llama_dir, **ENGINE)
        llm.llm_engine.runner.execute = remote_execute
        got = _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        got_embeddings = _embeddings(llm)  # pooling requests: pooling params in, vectors out
    finally:
        parent.send_bytes(b"")
        worker.join(timeout=60)
    assert got == expected
    assert got_embeddings == expected_embeddings
    assert any(m.preempted_ids for m in messages) and any(m.new_requests for m in messages)


def test_messages_hold_plain_data_only(llama_dir):
    """What the scheduler sends is new-request facts once, then counts and new block ids."""
    llm = LLM(llama_dir, **ENGINE)
    engine = llm.llm_engine
    seen: list[SchedulerOutput] = []
    execute = engine.runner.execute

    def recording(scheduler_output):
        seen.append(pickle.loads(pickle.dumps(scheduler_output)))
        return execute(scheduler_output)

    engine.runner.execute = recording
    llm.generate(PROMPTS[:3], PARAMS[:3], use_tqdm=False)
    introduced: dict[str, int] = {}
    for step, message in enumerate(seen):
        for new in message.new_requests:
            assert isinstance(new, NewRequestData) and new.request_id not in introduced, "introduced once"
            introduced[new.request_id] = step
        for item in message.scheduled:
            assert isinstance(item, ScheduledRequestData)
            assert introduced.get(item.request_id, step + 1) <= step, "scheduled after its introduction"
    assert len(introduced) == 4  # three prompts, one of them with n=2


def test_messages_survive_a_pickle_round_trip():
    params = SamplingParams(temperature=0.5, seed=9, logit_bias={3: 1.5}, stop=["x"])
    out = SchedulerOutput(new_requests=[NewRequestData("a", [1, 2, 3], params, frozenset({2}))],
                          scheduled=[ScheduledRequestData("a", 0, 3, ([4, 5],))], preempted_ids=["b"],
                          finished_ids=["c"])
    answer = ModelRunnerOutput(sampled={"a": SampledTokens([7], [SampledLogprobs([7, 1], [-0.1, -2.5], [1, 2])])},
                               prompt_logprobs={"a": [SampledLogprobs([2], [-1.0], [1])]}, pooled={"d": [0.6, 0.8]})
    pooling = NewRequestData("d", [1, 2], None, frozenset(), PoolingParams("mean"))
    assert pickle.loads(pickle.dumps(pooling)) == pooling
    assert pickle.loads(pickle.dumps(out)) == out
    assert pickle.loads(pickle.dumps(answer)) == answer


@pytest.mark.parametrize("token_ids, stop_after", [([5, 0, 6], 2), ([5, 6, 8], None)])
def test_several_tokens_per_step_stop_inside_the_run(token_ids, stop_after):
    """A runner that returns several tokens for a request (verified drafts): the core appends them in order and
    a stop token among them ends the request there, dropping the rest."""
    from fake_runner import fake_runner_output
    from test_scheduler import EOS, make_request, make_scheduler

    assert EOS == 0
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=10))
    out = sched.schedule()
    answer = fake_runner_output(sched, out, 9)
    answer.sampled["a"] = SampledTokens(token_ids)
    (result,) = sched.update_from_output(out, answer)
    if stop_after is None:
        assert result.new_token_ids == token_ids and result.finish_reason is None
        assert sched.requests["a"].num_output_tokens == 3
    else:
        assert result.new_token_ids == token_ids[:stop_after] and result.finish_reason == "stop"
        assert "a" not in sched.requests


def test_seeded_sampling_unchanged_by_preemption(llama_dir):
    """The runner keeps a preempted request's state (its generator among it) until the request finishes, so a
    seeded request draws the same tokens whether or not it was preempted on the way."""
    seeded = [p for p in PARAMS if p.seed is not None]
    prompts = PROMPTS[:len(seeded)]
    roomy = LLM(llama_dir, **{**ENGINE, "kv_cache_memory": 1 << 22})
    tight = LLM(llama_dir, **ENGINE)
    assert _summary(tight.generate(prompts, seeded, use_tqdm=False)) == \
        _summary(roomy.generate(prompts, seeded, use_tqdm=False))
    assert tight.llm_engine.scheduler.num_preemptions > 0 and roomy.llm_engine.scheduler.num_preemptions == 0
