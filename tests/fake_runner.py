"""A stand-in for the model runner in scheduler tests: answers a SchedulerOutput as the runner would, without
a model, sampling whatever token the test chooses."""

from __future__ import annotations

from typing import Callable, Union

from folio.core.scheduler import Scheduler
from folio.core.step_contract import ModelRunnerOutput, SampledTokens, SchedulerOutput


def fake_runner_output(sched: Scheduler, out: SchedulerOutput,
                       token: Union[int, Callable[[], int]]) -> ModelRunnerOutput:
    """One token for every request whose chunk reaches its last known token (token() is called per request)."""
    sampled = {}
    for item in out.scheduled:
        if item.num_computed_tokens + item.num_tokens == sched.requests[item.request_id].num_tokens:
            sampled[item.request_id] = SampledTokens([token() if callable(token) else token])
    return ModelRunnerOutput(sampled=sampled)
