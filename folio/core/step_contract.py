"""The step contract: the two messages the engine core and the model runner exchange every step.

The scheduler sends a `SchedulerOutput`; the runner answers with a `ModelRunnerOutput`. Both are plain data
(ids, token ids, counts, SamplingParams), never callbacks or live objects shared with the other side, so each
survives a pickle round trip and a runner can live in another process (a tensor-parallel worker, a Ray actor).

What the runner is told, and what it keeps:
  * the first time a request is scheduled, everything about it that does not change (`NewRequestData`:
    prompt, sampling parameters with their seed, the tokens that min_tokens holds back; or, for a request
    that wants its prompt pooled into an embedding, pooling parameters instead of sampling ones);
  * every step, per scheduled request, only what changed (`ScheduledRequestData`: how many tokens it has
    in the cache, how many to compute, the blocks it gained, draft tokens to verify);
  * which requests were preempted (their blocks are gone: the runner drops their block tables but keeps
    their state, a seeded generator included, for when they resume) and which finished (forgotten).
  * for requests whose output is constrained (structured outputs), the tokens they may sample, as a bitmask.
The runner owns all per-request state from then on (token rows, block tables, generators, the history
penalties count): it appends the tokens it samples itself, which the core appends to its own `Request` when
it reads the answer. The core decides when a request stops; the runner learns it from `finished_ids`.
A pooling request is answered with its vector when its last prompt token is computed, and the core ends it.

Speculative decoding: the runner's answer may carry draft tokens per request; the scheduler gives them back
in the next step as `draft_token_ids` after the request's known tokens, and the runner answers with the
accepted drafts plus one token. The core then rolls its computed-token count back past the rejected drafts
(their KV is written but never trusted, nor published to the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: sent once, in the step that first schedules it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams]  # with its seed (the runner owns the generator); None when pooling
    stop_token_ids: frozenset[int]  # held back until min_tokens: params.stop_token_ids, plus EOS unless ignore_eos
    pooling_params: Optional[PoolingParams] = None  # set instead of sampling_params: pool the prompt, sample nothing


@dataclass
class ScheduledRequestData:
    """One request's share of a step."""

    request_id: str
    num_computed_tokens: int  # tokens whose KV is in the cache before this step (cache hits, earlier chunks)
    num_tokens: int  # tokens to compute this step, from num_computed_tokens on (draft tokens included)
    # Per KV cache group (one, unless the model has sliding-window layers): blocks allocated since the runner
    # last heard of this request, in table order. When the runner holds no block table for it (first
    # scheduled, or resumed after a preemption) these are its whole tables.
    new_block_ids: tuple[list[int], ...] = field(default_factory=lambda: ([],))
    # Speculative decoding: guessed tokens after the known ones, computed this step and verified by sampling.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """Structured outputs: which tokens each constrained request may sample in this step. A request has rows
    rows[request_id], rows[request_id] + 1, ...: the token after its known ones, then after each of its draft
    tokens. Token t is allowed iff bit t % 32 of word t // 32 of the row is set."""

    rows: dict[str, int]  # request id -> its first row
    bitmask: np.ndarray  # int32 [rows, ceil(vocab_size / 32)]

    def rows_of(self, request_id: str, count: int) -> Optional[np.ndarray]:
        """The request's first `count` rows (its next token's, then one per draft); None when unconstrained."""
        first = self.rows.get(request_id)
        return None if first is None else self.bitmask[first:first + count]


@dataclass
class SchedulerOutput:
    """What the model runner computes in one step, and what changed since the previous one."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequestData] = field(default_factory=list)  # the batch, in order
    preempted_ids: list[str] = field(default_factory=list)  # blocks freed: drop the block table, keep the state
    finished_ids: list[str] = field(default_factory=list)  # ended since the previous step: forget them
    grammar_bitmask: Optional[GrammarBitmask] = None  # set by the engine core when constrained requests sample

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SampledLogprobs:
    """Top-k tokens of one position, then the chosen token if it is not among them."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank in the whole vocabulary


@dataclass
class SampledTokens:
    """The tokens one request gained in a step: one, or (drafts verified) the accepted drafts plus one."""

    token_ids: list[int]
    logprobs: list[SampledLogprobs] = field(default_factory=list)  # one per token if the request asked, else none


@dataclass
class ModelRunnerOutput:
    """The runner's answer to one SchedulerOutput, keyed by request id."""

    # requests whose computed tokens reached their last known token, so the step sampled for them
    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    # logprobs of the prompt tokens that this step's chunk predicts, for requests that asked for them: entry i
    # belongs to position num_computed_tokens + i (predicting the token after it)
    prompt_logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    # speculative decoding: guesses of the tokens after each request's last sampled one, to verify next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # pooling requests whose computed tokens reached the end of the prompt: their vector, instead of a sample
    pooled: dict[str, list[float]] = field(default_factory=dict)
