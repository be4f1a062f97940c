"""Rejection sampler: verifies a step's draft tokens against the target model, so speculation is exact.

A request with k drafts brings k + 1 rows of logits: the target's distribution at the position of each
draft and one after the last. Each row is processed as the sampler would process it had the drafts before it
been generated (logits processors see the history extended by them: penalties, min_tokens), then:
  * greedy requests keep the longest run of drafts equal to the target's argmax, then the target's own
    token: exactly the tokens decoding without speculation gives;
  * random requests follow Leviathan et al. (arXiv 2211.17192) with a one-hot draft distribution (n-gram and
    suffix drafts have no probabilities): draft x is accepted with probability p(x) under the target's
    processed distribution p; at the first rejection the token is drawn from p with x removed (norm(max(0,
    p - onehot(x)))); when all are accepted a bonus token is drawn from the last row. The output then has the
    target's distribution exactly.
Seeded requests draw every uniform from their own generator, so their tokens depend only on seed and history.
Logprobs (when asked) are those of the raw distribution at each output token's row, as without speculation.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.core.step_contract import SampledLogprobs, SampledTokens
from folio.sample.logits_processors import LogitsProcessor
from folio.sample.sampler import gather_logprobs, process_logits, random_weights
from folio.sample.sampling_metadata import SamplingMetadata
from folio.sample.sampling_ops import argmax_rows, draw_rows
from folio.worker.request_state import RequestState


class DraftPosition:
    """A request as the sampler sees it at one verified position: its output extended by the drafts before
    that position (what logits processors read), everything else its own."""

    __slots__ = ("request", "drafts_before")

    def __init__(self, request: RequestState, drafts_before: list[int]) -> None:
        self.request = request
        self.drafts_before = drafts_before

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self):
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        out = self.request.output_token_ids
        return out + self.drafts_before if self.drafts_before else out

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.request.generator


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, requests: list[RequestState], drafts: list[list[int]],
                 processors: list[LogitsProcessor]) -> list[SampledTokens]:
        """logits: [sum(len(d) + 1 for d in drafts), V], request i's rows in a run, in order. Returns each
        request's accepted drafts followed by one token of the target's (with their logprobs if asked)."""
        positions = [DraftPosition(r, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        if logits.dim() != 2 or logits.shape[0] != len(positions):
            raise ValueError(f"logits must be [{len(positions)} rows, V], got {tuple(logits.shape)}")
        meta = SamplingMetadata.build(positions, processors)
        targets, weights, raw_logprobs = self._target(logits, meta)

        first = 0
        random_finals: list[tuple[int, int, int]] = []  # (request index, row of its final draw, token to drop)
        uniforms: dict[int, torch.Tensor] = {}
        results: list[list[int]] = []
        for i, (request, draft) in enumerate(zip(requests, drafts)):
            rows = range(first, first + len(draft) + 1)
            first += len(draft) + 1
            if request.params.is_greedy:
                accepted = _greedy_run(draft, [targets[r] for r in rows])
                results.append(draft[:accepted] + [targets[rows[accepted]]])
                continue
            u = _uniforms(request, len(draft) + 1)
            accepted = _accepted_run(draft, [weights[r] for r in rows[:-1]], u[:-1])
            uniforms[i] = u[-1:]
            results.append(draft[:accepted])
            random_finals.append((i, rows[accepted], draft[accepted] if accepted < len(draft) else -1))
        if random_finals:
            finals = torch.stack([weights[row] for _, row, _ in random_finals])  # copies: the drop below is local
            for q, (_, _, dropped) in enumerate(random_finals):
                if dropped >= 0:
                    finals[q, dropped] = 0.0
            tokens = draw_rows(finals, torch.cat([uniforms[i] for i, _, _ in random_finals])).tolist()
            for (i, _, _), token in zip(random_finals, tokens):
                results[i].append(token)
        return self._with_logprobs(requests, drafts, results, raw_logprobs)

    @staticmethod
    def _target(logits: torch.Tensor, meta: SamplingMetadata):
        """Per row: the greedy target token (greedy rows), the processed weights (random rows) and the raw
        logprobs (rows that want them), each indexable by the row's index in the step."""
        num_rows = len(meta.requests)
        targets: list[int] = [0] * num_rows
        weights: dict[int, torch.Tensor] = {}
        raw_logprobs: dict[int, torch.Tensor] = {}
        if meta.fast_rows:
            fast = logits if len(meta.fast_rows) == num_rows else logits[torch.tensor(meta.fast_rows)]
            for row, token in zip(meta.fast_rows, argmax_rows(fast).tolist()):
                targets[row] = token
        if not meta.full_rows:
            return targets, weights, raw_logprobs
        full = logits[torch.tensor(meta.full_rows)].to(torch.float32)  # a private copy, processed in place
        if meta.logprob_rows:
            for position, lp in zip(meta.logprob_rows, torch.log_softmax(full[torch.tensor(meta.logprob_rows)], -1)):
                raw_logprobs[meta.full_rows[position]] = lp
        process_logits(full, meta)
        random = set(meta.random_rows)
        greedy = [p for p in range(len(meta.full_rows)) if p not in random]
        if greedy:
            for position, token in zip(greedy, argmax_rows(full[torch.tensor(greedy)]).tolist()):
                targets[meta.full_rows[position]] = token
        if meta.random_rows:
            rows = [meta.full_rows[p] for p in meta.random_rows]
            for row, w in zip(rows, random_weights(full[torch.tensor(meta.random_rows)],
                                                   [meta.requests[r] for r in rows])):
                weights[row] = w
        return targets, weights, raw_logprobs

    @staticmethod
    def _with_logprobs(requests: list[RequestState], drafts: list[list[int]], results: list[list[int]],
                       raw_logprobs: dict[int, torch.Tensor]) -> list[SampledTokens]:
        out = []
        first = 0
        for request, draft, tokens in zip(requests, drafts, results):
            logprobs: list[SampledLogprobs] = []
            if request.params.logprobs is not None:
                rows = torch.stack([raw_logprobs[first + j] for j in range(len(tokens))])
                logprobs = gather_logprobs(rows, torch.tensor(tokens), [request.params.logprobs] * len(tokens))
            out.append(SampledTokens(tokens, logprobs))
            first += len(draft) + 1
        return out


def _greedy_run(draft: list[int], targets: list[int]) -> int:
    """How many drafts equal the target's argmax at their position, from the first on."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def _accepted_run(draft: list[int], weights: list[torch.Tensor], u: torch.Tensor) -> int:
    """How many drafts pass the test u < p(x) in a row, p the target's normalised weights at x's position."""
    accepted = 0
    for x, w, u_j in zip(draft, weights, u.tolist()):
        if not u_j * float(w.sum()) < float(w[x]):
            break
        accepted += 1
    return accepted


def _uniforms(request: RequestState, n: int) -> torch.Tensor:
    """n uniforms in [0, 1): from the request's own generator when seeded, else from the global one."""
    return torch.rand(n, generator=request.generator)
