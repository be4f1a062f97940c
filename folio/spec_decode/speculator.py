"""Speculator: the model runner's side of speculative decoding. After each step it asks the proposer for the
next drafts of the requests that sampled, as many as the adaptive policy allows each one, and it learns from
how many of them the rejection sampler accepted and from how long the steps took.

How the policy decides (measured in the README): it gives out the drafts that maximise the expected tokens
per second of the next step.
  * acceptance: each request keeps, per draft position, a decayed count of the drafts tried there and
    accepted (a rejection ends a run, so a position is tried only when all before it were accepted). The i-th
    draft of a step is used only if it and all before it are accepted: its chance, the product of those
    positions' rates, is what it adds to the step's expected yield.
  * cost: the runner reports every decode step's time to a StepCostModel, so the policy knows what a step of
    n tokens costs on this machine, with this model, batch and load: where a step is bound by reading the
    weights (small batches) a few more tokens are nearly free; where the matmuls are compute-bound (large
    batches) every verified token costs its share, and only nearly certain guesses pay.
  * choice: with B requests decoding, the candidate drafts (every request's i-th, with its chance a^i) are
    taken most likely first, while (B + their chances) / cost(B + their number) keeps its best value. A request
    whose guesses keep failing gets none; after PROBE_EVERY steps without drafts its rates are taken as at least
    the prior's for one step, so that it is tried again when its text starts repeating (each probe that fails
    doubles the wait, so a request that never repeats costs next to nothing).
  * exploration: the cost model knows only the step sizes it has seen lately, and one slow moment (a kernel
    built on first use, a burst of load) could otherwise rule speculation out for good. So when the policy
    has allowed no draft for EXPLORE_EVERY steps, the request that has waited longest gets its full room of drafts
    whatever the estimates say: its acceptance and the cost of a longer step are measured afresh. Each
    exploration whose drafts are all rejected doubles the wait for the next (one that pays resets it), which
    bounds its cost to a few tokens in hundreds of steps where nothing repeats.
  * limits: never more drafts than num_speculative_tokens, or than the request's max_tokens or the context
    length leave room for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.step_cost import StepCostModel
from folio.worker.request_state import RequestState

PRIOR_RATE = 0.5  # a draft position's acceptance rate before any verification
PROBE_EVERY = 8  # steps without drafts before a request's guesses are tried again (doubling while they fail)
DECAY = 0.9  # weight of the past in the acceptance counts: the last ten or so verifications count
EXPLORE_EVERY = 32  # steps without any draft before one request's drafts are tried regardless of the estimates


@dataclass
class _Acceptance:
    """A request's guessing record, per draft position: how often a step tried a draft there (every draft before
    it accepted) and how often it was accepted, both decayed. Runs of accepted guesses are bursty (a request
    copying text gets long runs, one that stopped copying gets none), so each position keeps its own rate
    instead of one rate for all."""

    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    steps_without_drafts: int = 0
    probe_every: int = PROBE_EVERY  # doubles with each probe that finds nothing accepted
    probing: bool = False  # its drafts of this step were given on optimistic rates

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for position in range(min(num_drafts, num_accepted + 1)):  # the positions this verification reached
            if position == len(self.tried):
                self.tried.append(0.0)
                self.accepted.append(0.0)
            self.tried[position] = DECAY * self.tried[position] + 1.0
            self.accepted[position] = DECAY * self.accepted[position] + (position < num_accepted)

    def chances(self, count: int, optimistic: bool) -> list[float]:
        """The chance that each of the next `count` drafts is used: the product of the acceptance rates of its
        position and those before it (a position never tried takes the last known rate, or the prior)."""
        out, chance, rate = [], 1.0, PRIOR_RATE
        for position in range(count):
            if position < len(self.tried):
                rate = (self.accepted[position] + PRIOR_RATE) / (self.tried[position] + 1.0)
            chance *= max(rate, PRIOR_RATE) if optimistic else rate
            out.append(chance)
        return out


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.step_cost = StepCostModel()
        self._acceptance: dict[str, _Acceptance] = {}
        self._steps_without_drafts = 0  # steps in which the policy allowed no draft
        self._explore_every = EXPLORE_EVERY  # doubles with each exploration that finds nothing accepted
        self._exploring: Optional[str] = None  # the request explored last, until its drafts are verified

    def propose(self, requests: list[RequestState], tokens: list[np.ndarray]) -> dict[str, list[int]]:
        """Drafts for the requests that just sampled (tokens[i]: requests[i]'s tokens so far)."""
        chosen = [(r, t, k) for r, t, k in zip(requests, tokens, self._allocate(requests)) if k > 0]
        if not chosen:
            return {}
        drafts = self.proposer.propose([r for r, _, _ in chosen], [t for _, t, _ in chosen], [k for _, _, k in chosen])
        return {r.request_id: d for (r, _, _), d in zip(chosen, drafts) if d}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step (every request sampled, none computed a prompt chunk) of num_tokens tokens took this."""
        self.step_cost.observe(num_tokens, seconds)

    def verified(self, request: RequestState, num_drafts: int, num_accepted: int) -> None:
        stats = self._acceptance.setdefault(request.request_id, _Acceptance())
        stats.record(num_drafts, num_accepted)
        if num_accepted:
            stats.probe_every = PROBE_EVERY
        elif stats.probing:
            stats.probe_every *= 2
        if request.request_id == self._exploring:
            self._explore_every = EXPLORE_EVERY if num_accepted else 2 * self._explore_every
            self._exploring = None

    def finished(self, request: RequestState) -> None:
        self._acceptance.pop(request.request_id, None)
        self.proposer.finished(request)

    def preempted(self, request_id: str) -> None:
        self.proposer.preempted(request_id)

    def _allocate(self, requests: list[RequestState]) -> list[int]:
        """How many drafts each request may get: the most likely drafts first, while the expected tokens per
        second of the next step grow (see above)."""
        candidates: list[tuple[float, int]] = []  # (chance the draft is used, request index)
        for i, request in enumerate(requests):
            stats = self._acceptance.setdefault(request.request_id, _Acceptance())
            stats.probing = stats.steps_without_drafts >= stats.probe_every
            candidates += [(chance, i) for chance in stats.chances(self._room(request), optimistic=stats.probing)]
        candidates.sort(key=lambda c: -c[0])
        base = len(requests)
        expected, best, best_value = float(base), 0, base / self.step_cost.cost(base)
        for m, (chance, _) in enumerate(candidates, 1):
            expected += chance
            value = expected / self.step_cost.cost(base + m)
            if value > best_value:
                best, best_value = m, value
        counts = [0] * len(requests)
        for _, i in candidates[:best]:
            counts[i] += 1
        self._steps_without_drafts = 0 if best else self._steps_without_drafts + 1
        if self._steps_without_drafts >= self._explore_every:
            i = max(range(len(requests)), key=lambda i: self._acceptance[requests[i].request_id].steps_without_drafts)
            counts[i] = self._room(requests[i])
            if counts[i]:
                self._exploring, self._steps_without_drafts = requests[i].request_id, 0
        for request, count in zip(requests, counts):
            stats = self._acceptance[request.request_id]
            stats.steps_without_drafts = 0 if count else stats.steps_without_drafts + 1
        return counts

    def _room(self, request: RequestState) -> int:
        """Drafts the request can use: the drafts and the token after them must fit its limits."""
        room = min(self.config.num_speculative_tokens, self.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(room, 0)
