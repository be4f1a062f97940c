"""Speculator: the model runner's side of speculative decoding. After each step it asks the proposer for the
next drafts of the requests that sampled, as many as the adaptive policy allows each one, and it learns from
how many of them the rejection sampler accepted and from how long the steps took.

How the policy decides (measured in the README): it gives out the drafts that maximise the expected tokens
per second of the next step.
  * acceptance: each request keeps a decayed count of its drafts accepted and tried (a rejection ends a run,
    so the tries are the accepted drafts plus one per rejection). With acceptance rate a, the i-th draft of a
    step is used only if all before it are accepted, with chance a^i: it adds a^i tokens to the step's
    expected yield.
  * cost: the runner reports every decode step's time to a StepCostModel, so the policy knows what a step of
    n tokens costs on this machine, with this model, batch and load: where a step is bound by reading the
    weights (small batches) a few more tokens are nearly free; where the matmuls are compute-bound (large
    batches) every verified token costs its share, and only nearly certain guesses pay.
  * choice: with B requests decoding, the candidate drafts (every request's i-th, with its chance a^i) are
    taken most likely first, for as long as (B + their chances) / cost(B + their number) grows. A request whose
    guesses keep failing gets none; every PROBE_EVERY steps without drafts its chance is taken as at least the
    prior's, so that it is tried again when its text starts repeating.
  * limits: never more drafts than num_speculative_tokens, or than the request's max_tokens or the context
    length leave room for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.step_cost import StepCostModel
from folio.worker.request_state import RequestState

PRIOR_RATE = 0.5  # one accepted and one rejected draft: what a request starts with
PROBE_EVERY = 8
DECAY = 0.9  # weight of the past in the acceptance counts: the last ten or so verifications count


@dataclass
class _Acceptance:
    accepted: float = 0.0
    tried: float = 0.0
    steps_without_drafts: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.tried + 2.0)  # the prior: one accepted and one rejected draft


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.step_cost = StepCostModel()
        self._acceptance: dict[str, _Acceptance] = {}

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
        stats.accepted = DECAY * stats.accepted + num_accepted
        stats.tried = DECAY * stats.tried + num_accepted + (num_accepted < num_drafts)

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
            rate = stats.rate
            if stats.steps_without_drafts % PROBE_EVERY == PROBE_EVERY - 1:
                rate = max(rate, PRIOR_RATE)
            chance = 1.0
            for _ in range(self._room(request)):
                chance *= rate
                candidates.append((chance, i))
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
