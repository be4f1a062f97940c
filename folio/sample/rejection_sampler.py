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

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from folio.core.step_contract import SampledLogprobs, SampledTokens
from folio.sample.logits_processors import LogitsProcessor
from folio.sample.sampler import gather_logprobs, process_full_rows
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
    def forbidden(self) -> Optional[torch.Tensor]:
        return self.request.forbidden

    @forbidden.setter
    def forbidden(self, mask: torch.Tensor) -> None:
        self.request.forbidden = mask

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.request.generator

    @property
    def token_bitmask(self) -> Optional[np.ndarray]:
        """Structured outputs: the grammar's mask at this position (after the drafts before it)."""
        masks = self.request.token_bitmasks
        return None if masks is None else masks[len(self.drafts_before)]


@dataclass
class _Targets:
    """What a step's rows verify drafts against, each indexable by the row's index in the step."""

    tokens: list[int]  # greedy rows: the target's token (other rows' entries are never read)
    weights: Optional[torch.Tensor]  # random rows' processed weights, one row each (weight_row says which)
    weight_row: dict[int, int]
    raw_logprobs: Optional[torch.Tensor]  # rows that want logprobs: the raw distribution (logprob_row says which)
    logprob_row: dict[int, int]


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, requests: list[RequestState], drafts: list[list[int]],
                 processors: list[LogitsProcessor]) -> list[SampledTokens]:
        """logits: [sum(len(d) + 1 for d in drafts), V], request i's rows in a run, in order. Returns each
        request's accepted drafts followed by one token of the target's (with their logprobs if asked)."""
        positions = [DraftPosition(r, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        if logits.dim() != 2 or logits.shape[0] != len(positions):
            raise ValueError(f"logits must be [{len(positions)} rows, V], got {tuple(logits.shape)}")
        targets = self._targets(logits, SamplingMetadata.build(positions, processors))
        firsts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))  # each request's first row

        randoms = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        uniforms = {i: _uniforms(requests[i], len(drafts[i]) + 1) for i in randoms}  # in request order
        # The acceptance test's numbers for every random request's drafts, read in one go: p(x) and the row's mass.
        checked = [targets.weight_row[firsts[i] + j] for i in randoms for j in range(len(drafts[i]))]
        probs: list[float] = []
        masses: list[float] = []
        draws: list[float] = []
        if checked:
            rows = torch.tensor(checked)
            probs = targets.weights[rows, torch.tensor([x for i in randoms for x in drafts[i]])].tolist()
            masses = targets.weights.sum(dim=-1)[rows].tolist()
            draws = torch.cat([uniforms[i][:-1] for i in randoms]).tolist()

        results: list[list[int]] = []
        random_finals: list[tuple[int, int, int]] = []  # (request index, row of its final draw, token to drop)
        checked_before = 0  # random requests' drafts before this request's, in probs, masses and draws
        for i, (request, draft) in enumerate(zip(requests, drafts)):
            first = firsts[i]
            if request.params.is_greedy:
                accepted = _greedy_run(draft, targets.tokens[first:first + len(draft) + 1])
                results.append(draft[:accepted] + [targets.tokens[first + accepted]])
                continue
            span = slice(checked_before, checked_before + len(draft))
            checked_before += len(draft)
            accepted = _accepted_run(probs[span], masses[span], draws[span])
            results.append(draft[:accepted])
            random_finals.append((i, first + accepted, draft[accepted] if accepted < len(draft) else -1))
        if random_finals:
            # a copy (indexing gathers): the drop below is local
            finals = targets.weights[torch.tensor([targets.weight_row[row] for _, row, _ in random_finals])]
            for q, (_, _, dropped) in enumerate(random_finals):
                if dropped >= 0:
                    finals[q, dropped] = 0.0
            tokens = draw_rows(finals, torch.cat([uniforms[i][-1:] for i, _, _ in random_finals])).tolist()
            for (i, _, _), token in zip(random_finals, tokens):
                results[i].append(token)
        return self._with_logprobs(requests, firsts, results, targets)

    @staticmethod
    def _targets(logits: torch.Tensor, meta: SamplingMetadata) -> _Targets:
        """Per row: the greedy target token (greedy rows), the processed weights (random rows) and the raw
        logprobs (rows that want them), the full rows processed as the Sampler processes them."""
        num_rows = len(meta.requests)
        tokens: list[int] = [0] * num_rows
        if meta.fast_rows:
            fast = logits if len(meta.fast_rows) == num_rows else logits[torch.tensor(meta.fast_rows)]
            for row, token in zip(meta.fast_rows, argmax_rows(fast).tolist()):
                tokens[row] = token
        if not meta.full_rows:
            return _Targets(tokens, None, {}, None, {})
        full = process_full_rows(logits if len(meta.full_rows) == num_rows else logits[torch.tensor(meta.full_rows)],
                                 meta)
        if full.argmax is not None:
            for row, token in zip(meta.full_rows, full.argmax.tolist()):
                tokens[row] = token
        return _Targets(tokens, full.weights, {meta.full_rows[p]: k for k, p in enumerate(meta.random_rows)},
                        full.raw_logprobs, {meta.full_rows[p]: k for k, p in enumerate(meta.logprob_rows)})

    @staticmethod
    def _with_logprobs(requests: list[RequestState], firsts: list[int], results: list[list[int]],
                       targets: _Targets) -> list[SampledTokens]:
        """Each request's tokens with their logprobs, if it asked: every output token's gathered in one go."""
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        gathered: list[SampledLogprobs] = []
        if wanted:
            rows = [targets.logprob_row[firsts[i] + j] for i in wanted for j in range(len(results[i]))]
            gathered = gather_logprobs(targets.raw_logprobs[torch.tensor(rows)],
                                       torch.tensor([t for i in wanted for t in results[i]]),
                                       [requests[i].params.logprobs for i in wanted for _ in results[i]])
        out = [SampledTokens(tokens, []) for tokens in results]
        entries = iter(gathered)
        for i in wanted:
            out[i].logprobs = list(itertools.islice(entries, len(results[i])))
        return out


def _greedy_run(draft: list[int], targets: list[int]) -> int:
    """How many drafts equal the target's argmax at their position, from the first on."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def _accepted_run(probs: list[float], masses: list[float], u: list[float]) -> int:
    """How many drafts pass the test u < p(x) in a row, from the first on: p(x) the target's weight at the draft
    x's position (probs) over the row's sum (masses)."""
    accepted = 0
    for p, mass, u_j in zip(probs, masses, u):
        if not u_j * mass < p:
            break
        accepted += 1
    return accepted


def _uniforms(request: RequestState, n: int) -> torch.Tensor:
    """n uniforms in [0, 1): from the request's own generator when seeded, else from the global one."""
    return torch.rand(n, generator=request.generator)
