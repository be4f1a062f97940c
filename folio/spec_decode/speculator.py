"""Speculator: the model runner's side of speculative decoding. After each step it asks the proposer for the
next drafts of the requests that sampled, as many as the adaptive policy allows each one, and it learns from
how many of them the rejection sampler accepted.

How the policy decides (measured in the README):
  * batch: while more than `max_batch_size` requests decode in a step, nothing is proposed. A CPU decode step
    at small batches reads every weight once whatever the number of tokens, so verifying guesses is nearly
    free; at large batches the matmuls become compute-bound and each verified token costs as much as a step's
    token, so a rejected guess is pure loss.
  * acceptance: each request keeps a decayed count of its drafts accepted and tried (a rejection ends a run,
    so the tries are the accepted drafts plus one per rejection). With acceptance rate a, the i-th draft of a
    step is used only if all before it are accepted, with chance a^i; drafts are proposed while a^i stays at
    least MIN_REACH_PROBABILITY. A request whose guesses keep failing drops to none, and tries one draft every
    PROBE_EVERY steps so that it can recover when its text starts repeating.
  * limits: never more drafts than the request's max_tokens or the context length leave room for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.proposer import Proposer
from folio.worker.request_state import RequestState

MIN_REACH_PROBABILITY = 0.2
PROBE_EVERY = 8
DECAY = 0.9  # weight of the past in the acceptance counts: the last ten or so verifications count


@dataclass
class _Acceptance:
    accepted: float = 0.0
    tried: float = 0.0
    steps_without_drafts: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.tried + 2.0)  # a prior of one accepted and one rejected draft


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._acceptance: dict[str, _Acceptance] = {}

    def propose(self, requests: list[RequestState], tokens: list[np.ndarray]) -> dict[str, list[int]]:
        """Drafts for the requests that just sampled (tokens[i]: requests[i]'s tokens so far)."""
        if len(requests) > self.config.max_batch_size:
            return {}
        chosen = [(r, t, k) for r, t in zip(requests, tokens) if (k := self._num_drafts(r)) > 0]
        if not chosen:
            return {}
        drafts = self.proposer.propose([r for r, _, _ in chosen], [t for _, t, _ in chosen], [k for _, _, k in chosen])
        return {r.request_id: d for (r, _, _), d in zip(chosen, drafts) if d}

    def verified(self, request: RequestState, num_drafts: int, num_accepted: int) -> None:
        stats = self._acceptance.setdefault(request.request_id, _Acceptance())
        stats.accepted = DECAY * stats.accepted + num_accepted
        stats.tried = DECAY * stats.tried + num_accepted + (num_accepted < num_drafts)

    def finished(self, request: RequestState) -> None:
        self._acceptance.pop(request.request_id, None)
        self.proposer.finished(request)

    def preempted(self, request_id: str) -> None:
        self.proposer.preempted(request_id)

    def _num_drafts(self, request: RequestState) -> int:
        room = self.max_model_len - request.num_tokens - 1  # the drafts and the token after them must fit
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        if room <= 0:
            return 0
        stats = self._acceptance.setdefault(request.request_id, _Acceptance())
        rate = stats.rate
        k = self.config.num_speculative_tokens if rate >= 1.0 else \
            int(math.log(MIN_REACH_PROBABILITY) / math.log(rate)) if rate > 0 else 0
        if k == 0:
            stats.steps_without_drafts += 1
            if stats.steps_without_drafts % PROBE_EVERY:
                return 0
            k = 1
        return min(k, self.config.num_speculative_tokens, room)
