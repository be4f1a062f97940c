"""Where an engine step's time goes, measured from outside the engine.

`profile_steps(engine)` swaps instance attributes for timed wrappers while its block runs and puts the originals
back after: the step itself, the scheduler's schedule/update_from_output/finish_requests, the attention
backend's build_metadata and forward, the model's forward, compute_logits and compute_greedy_tokens (both
"lm_head": an all-greedy step takes its tokens from the head), the sampler and the output
processor. The engine's code is not edited, so the profile follows whatever the engine does today, and a phase
the engine stops calling shows up as zero (its time lands in "other"). CPU ops run synchronously, so wall time
around a call is its cost; a wrapper costs about a microsecond, per layer for attention. A mixture-of-experts
model's steps also count their expert runs (folio.models.moe.Experts.runs): how many of the model's experts a
step ran, and the most runs of any one expert in a step, which is 1 when each expert's weights are read once.

The phases are exclusive and add up to the step: "model forward" excludes the attention inside it, "sampling"
the grammar mask applied inside it (structured outputs; "grammar bitmask" is the engine core filling that mask
before the forward), and "other" is what no wrapper saw (flattening the batch, block tables, Python glue).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from folio.core.request import Request
from folio.engine.llm_engine import LLMEngine
from folio.models.moe import Experts
from folio.structured_output.token_mask import GrammarTokenMask

# Printed in this order; each is a share of the step.
PHASES = ("scheduling", "grammar bitmask", "attention metadata", "model forward", "attention", "lm_head",
          "sampling", "grammar mask apply", "output processing", "other")


@dataclass
class PhaseTime:
    total_s: float
    per_step_ms: float
    percent: float  # of the summed step time


@dataclass
class StepKind:
    """Steps of one kind: decode-only (every request past its prompt) or with prompt tokens (prefill)."""

    num_steps: int
    mean_ms: Optional[float]
    mean_requests: Optional[float]  # requests in the batch
    mean_tokens: Optional[float]  # tokens computed per step
    phase_ms: dict[str, float]  # per step of this kind, each of PHASES (empty when there is none)
    mean_expert_runs: Optional[float] = None  # MoE models: expert MLPs run per step, over all layers
    max_runs_per_expert: Optional[int] = None  # MoE models: the most times one expert ran in one step


@dataclass
class StepBreakdown:
    num_steps: int
    step_total_s: float
    step_mean_ms: float
    model_forward_with_attention_ms: float  # per step: the model's forward as a whole
    phases: dict[str, PhaseTime]
    decode: StepKind
    prefill: StepKind


@dataclass
class _Step:
    ns: int
    requests: int
    tokens: int
    decode_only: bool
    phase_ns: dict[str, int]  # what the wrappers saw during this step
    expert_runs: list[int]  # per expert of the model (all MoE layers), its runs in this step


class StepProfile:
    """Accumulates phase times while installed; `breakdown()` reads them out."""

    def __init__(self, experts: list[Experts]) -> None:
        self._experts = experts  # the model's MoE layers' experts, if any
        self._ns: dict[str, int] = defaultdict(int)  # the step being run
        self._steps: list[_Step] = []
        self._shape = (0, 0, False)  # (requests, tokens, decode_only) of the step being run
        self._open: set[str] = set()  # the phases whose wrapper is running

    def _timed(self, fn: Callable, phase: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if phase in self._open:  # a call within the same phase (greedy tokens through the logits) counts once
                return fn(*args, **kwargs)
            self._open.add(phase)
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self._ns[phase] += time.perf_counter_ns() - start
                self._open.discard(phase)
        return timed

    def _schedule(self, fn: Callable, requests: dict[str, Request]) -> Callable:
        """Times the scheduler and reads the step's shape from its output (requests: the scheduler's own)."""
        timed = self._timed(fn, "scheduling")

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = timed(*args, **kwargs)
            items = out.scheduled
            self._shape = (len(items), sum(i.num_tokens for i in items),
                           bool(items) and all(i.num_computed_tokens >= requests[i.request_id].num_prompt_tokens
                                               for i in items))
            return out
        return schedule

    def _expert_runs(self) -> list[int]:
        return [n for experts in self._experts for n in experts.runs.tolist()]

    def _step(self, fn: Callable) -> Callable:
        def step(*args: Any, **kwargs: Any) -> Any:
            start, runs = time.perf_counter_ns(), self._expert_runs()
            try:
                return fn(*args, **kwargs)
            finally:
                ran = [after - before for after, before in zip(self._expert_runs(), runs)]
                self._steps.append(_Step(time.perf_counter_ns() - start, *self._shape, phase_ns=dict(self._ns),
                                         expert_runs=ran))
                self._ns.clear()
        return step

    def breakdown(self) -> StepBreakdown:
        total_ns = sum(s.ns for s in self._steps)
        n = len(self._steps)
        ns = _exclusive(self._steps)
        phases = {name: PhaseTime(ns[name] / 1e9, ns[name] / 1e6 / max(n, 1),
                                  100.0 * ns[name] / total_ns if total_ns else 0.0) for name in PHASES}
        forward = sum(s.phase_ns.get("model forward", 0) for s in self._steps)
        return StepBreakdown(n, total_ns / 1e9, total_ns / 1e6 / max(n, 1), forward / 1e6 / max(n, 1), phases,
                             _kind([s for s in self._steps if s.decode_only]),
                             _kind([s for s in self._steps if s.tokens and not s.decode_only]))


def _exclusive(steps: list[_Step]) -> dict[str, int]:
    """Summed phase times of the steps, made exclusive: forward without attention, other = the rest."""
    ns: dict[str, int] = defaultdict(int)
    for s in steps:
        for name, t in s.phase_ns.items():
            ns[name] += t
    ns["model forward"] -= ns["attention"]
    ns["sampling"] -= ns["grammar mask apply"]
    ns["other"] = sum(s.ns for s in steps) - sum(ns[name] for name in PHASES if name != "other")
    return ns


def _kind(steps: list[_Step]) -> StepKind:
    if not steps:
        return StepKind(0, None, None, None, {})
    n = len(steps)
    ns = _exclusive(steps)
    moe = bool(steps[0].expert_runs)
    return StepKind(n, sum(s.ns for s in steps) / 1e6 / n, sum(s.requests for s in steps) / n,
                    sum(s.tokens for s in steps) / n, {name: ns[name] / 1e6 / n for name in PHASES},
                    sum(sum(s.expert_runs) for s in steps) / n if moe else None,
                    max(max(s.expert_runs) for s in steps) if moe else None)


@contextlib.contextmanager
def profile_steps(engine: LLMEngine) -> Iterator[StepProfile]:
    """Time the phases of every engine.step() run inside the block."""
    runner = engine.runner
    profile = StepProfile([m for m in runner.model.modules() if isinstance(m, Experts)])
    wrappers = [
        (engine, "step", profile._step),
        (engine.scheduler, "schedule", lambda fn: profile._schedule(fn, engine.scheduler.requests)),
        (engine.scheduler, "update_from_output", lambda fn: profile._timed(fn, "scheduling")),
        (engine.scheduler, "finish_requests", lambda fn: profile._timed(fn, "scheduling")),
        (runner.backend, "build_metadata", lambda fn: profile._timed(fn, "attention metadata")),
        (runner.backend, "forward", lambda fn: profile._timed(fn, "attention")),
        (runner.model, "forward", lambda fn: profile._timed(fn, "model forward")),
        (runner.model, "compute_logits", lambda fn: profile._timed(fn, "lm_head")),
        (runner.model, "compute_greedy_tokens", lambda fn: profile._timed(fn, "lm_head")),
        (runner, "sampler", lambda fn: profile._timed(fn, "sampling")),
        (engine.structured_output, "grammar_bitmask", lambda fn: profile._timed(fn, "grammar bitmask")),
        *[(p, "apply", lambda fn: profile._timed(fn, "grammar mask apply"))
          for p in runner.logits_processors if isinstance(p, GrammarTokenMask)],
        (engine.output_processor, "process", lambda fn: profile._timed(fn, "output processing")),
    ]
    restore = []
    try:
        for owner, name, wrap in wrappers:
            own = vars(owner).get(name)  # an instance attribute (the sampler) is put back; a method is un-shadowed
            setattr(owner, name, wrap(getattr(owner, name)))
            restore.append((owner, name, own))
        yield profile
    finally:
        for owner, name, own in reversed(restore):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
