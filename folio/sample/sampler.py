"""Batched sampler: one call turns a [B, V] logits batch into one token per request, in vLLM V1's order.

Order (vLLM V1): raw logprobs -> the logits processors (folio.sample.logits_processors: logit_bias, min_tokens,
penalties) -> greedy argmax, or temperature -> min_p -> top_k -> top_p -> inverse-transform sampling.
Which rows need what is decided once per step (folio.sample.sampling_metadata). Plain greedy rows (no
processor, no logprobs) are an argmax of the model's own logits; the rest work on a private float32 copy.
Every pass is a batched tensor op over the rows that need it; a row that does not use a pass gets a neutral
value (min_p 0) or is left out (processors, top_k, top_p), so its numbers never depend on its neighbours and
a seeded request's tokens depend only on its seed and its own history.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from folio.core.step_contract import SampledLogprobs
from folio.sample.logits_processors import rows_in_place
from folio.sample.sampling_metadata import SamplingMetadata
from folio.sample.sampling_ops import argmax_rows, draw_rows, top_p_mask
from folio.worker.request_state import RequestState

logger = logging.getLogger("folio")


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[Optional[SampledLogprobs]]  # None for rows without params.logprobs


class Sampler:
    """Stateless: all per-request state (history, generator) and the logits processors to run come in with the
    step's SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        n = len(metadata.requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [{n} rows, V], got {tuple(logits.shape)}")
        if not metadata.full_rows:  # the common case: read the model's logits once, copy nothing
            return SamplerOutput(sampled_token_ids=argmax_rows(logits).tolist(), logprobs=[None] * n)
        if not metadata.fast_rows:
            return self._sample(logits, metadata)
        # a mixed batch: plain greedy rows take the fast path, the others the full one
        fast = argmax_rows(logits[torch.tensor(metadata.fast_rows, device=logits.device)]).tolist()
        full = self._sample(logits[torch.tensor(metadata.full_rows, device=logits.device)], metadata)
        tokens: list[int] = [0] * n
        logprobs: list[Optional[SampledLogprobs]] = [None] * n
        for i, token in zip(metadata.fast_rows, fast):
            tokens[i] = token
        for i, token, lp in zip(metadata.full_rows, full.sampled_token_ids, full.logprobs):
            tokens[i], logprobs[i] = token, lp
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """The full path over the metadata's full rows (logits holds just those): raw logprobs, logits
        processors, greedy or random choice."""
        rows = process_full_rows(logits, metadata)
        requests = metadata.subset(metadata.full_rows)
        random_rows = metadata.random_rows
        if rows.argmax is None:
            sampled = draw(rows.weights, requests)
        else:
            sampled = rows.argmax  # the answer for greedy rows; random rows are overwritten below
            if random_rows:
                index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
                sampled[index] = draw(rows.weights, [requests[i] for i in random_rows])

        lp_rows = metadata.logprob_rows
        logprobs: list[Optional[SampledLogprobs]] = [None] * len(requests)
        if lp_rows:
            lp_index = torch.tensor(lp_rows, dtype=torch.long, device=logits.device)
            gathered = gather_logprobs(rows.raw_logprobs, sampled[lp_index],
                                       [requests[i].params.logprobs for i in lp_rows])
            for i, entry in zip(lp_rows, gathered):
                logprobs[i] = entry
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)


@dataclass
class FullRows:
    """A step's full rows after processing, split by how each chooses its token: what the Sampler draws from
    and what the RejectionSampler verifies drafts against."""

    raw_logprobs: Optional[torch.Tensor]  # [len(logprob_rows), V]: the raw distribution, before any processing
    argmax: Optional[torch.Tensor]  # [len(full_rows)]: the greedy rows' tokens; None when every row is random
    weights: Optional[torch.Tensor]  # [len(random_rows), V]: the random rows' weights (random_weights), or None


def process_full_rows(logits: torch.Tensor, metadata: SamplingMetadata) -> FullRows:
    """Raw logprobs, logits processors, then greedy argmax or random weights, over the metadata's full rows
    (logits holds just those, and is left untouched)."""
    # A private float32 copy: processors work in place and the caller's tensor stays untouched.
    logits = logits.to(torch.float32, copy=True)
    device = logits.device
    # vLLM V1 reports logprobs of the model's raw distribution, so take them before any processing.
    lp_rows = metadata.logprob_rows
    raw_logprobs = None
    if lp_rows:
        raw_logprobs = torch.log_softmax(logits[torch.tensor(lp_rows, dtype=torch.long, device=device)], dim=-1)

    process_logits(logits, metadata)

    requests = metadata.subset(metadata.full_rows)
    random_rows = metadata.random_rows
    if len(random_rows) == len(requests):
        return FullRows(raw_logprobs, None, random_weights(logits, requests))  # logits is private: no copy
    argmax = argmax_rows(logits)
    weights = None
    if random_rows:
        index = torch.tensor(random_rows, dtype=torch.long, device=device)
        weights = random_weights(logits[index], [requests[i] for i in random_rows])
    return FullRows(raw_logprobs, argmax, weights)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place on the full rows' float32 logits: each logits processor on the rows it applies to. A row the
    processors left without any token (masks that together forbid every one: allowed_token_ids and a bad word's
    last token, or min_tokens' stop tokens; admission refuses the combinations it can see) may take its stop
    tokens, so that the request ends rather than draw a token outside the vocabulary."""
    masked: set[int] = set()
    for processor, rows in metadata.processors:
        processor.apply(logits, rows, [metadata.requests[metadata.full_rows[i]] for i in rows])
        if processor.masks:
            masked.update(rows)
    if masked:
        rows = sorted(masked)
        emptied = ~torch.isfinite(logits[torch.tensor(rows, device=logits.device)].amax(dim=-1))
        for row in (rows[i] for i in torch.nonzero(emptied).flatten().tolist()):
            request = metadata.requests[metadata.full_rows[row]]
            stops = [t for t in request.stop_token_ids if t < logits.shape[1]] or [0]  # (ignore_eos, no stop ids)
            logger.warning("request %s: its constraints forbid every token; it ends", request.request_id)
            logits[row, stops] = 0.0


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: list[int],
                            num_logprobs: int) -> list[SampledLogprobs]:
    """Logprobs of each prompt token under the raw logits of the position before it (logits[i] -> target i)."""
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(f"logits must be [len(target_token_ids)={len(target_token_ids)}, V], "
                         f"got {tuple(logits.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_token_ids, dtype=torch.long, device=logits.device)
    return gather_logprobs(logprobs, targets, [num_logprobs] * len(target_token_ids))


def random_weights(logits: torch.Tensor, rows: list[RequestState]) -> torch.Tensor:
    """The distribution each random row samples from, as unnormalised weights: logits (a private [R, V]
    tensor, turned into the weights in place) after temperature, min_p, top_k and top_p."""
    device = logits.device
    logits /= torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)

    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p): no softmax needed; min_p 0 gives -inf.
        threshold = logits.amax(dim=-1, keepdim=True) + torch.tensor(min_p, device=device).log().unsqueeze(1)
        logits.masked_fill_(logits < threshold, -math.inf)

    vocab_size = logits.shape[1]
    top_k_rows = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab_size]
    if top_k_rows:
        _apply_top_k(logits, top_k_rows, [rows[i].params.top_k for i in top_k_rows])
    top_p_rows = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if top_p_rows:
        _apply_top_p(logits, top_p_rows, [rows[i].params.top_p for i in top_p_rows])

    # softmax's numerators, in place (a [64, 151936] float32 temporary costs more in page faults than in
    # arithmetic): the draw needs weights, not normalised probabilities; masked tokens get exactly 0
    return logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()


def _apply_top_k(logits: torch.Tensor, row_ids: list[int], top_k: list[int]) -> None:
    """In place on the given rows: drop tokens below the k-th largest value (ties with it stay).

    topk(max k) instead of a full-vocabulary sort; the k-th value itself is unique, so the result does
    not depend on how topk orders ties or on the other rows' k.
    """
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    with rows_in_place(logits, row_ids) as sub:
        kth = sub.topk(max(top_k), dim=-1).values.gather(1, k - 1)
        sub.masked_fill_(sub < kth, -math.inf)


def _apply_top_p(logits: torch.Tensor, row_ids: list[int], top_p: list[float]) -> None:
    """In place on the given rows: keep the smallest most-likely-first set whose mass reaches top_p
    (sampling_ops.top_p_mask: no sort of the vocabulary; it depends only on the row's own logits)."""
    with rows_in_place(logits, row_ids) as sub:
        keep = top_p_mask(sub.softmax(dim=-1), torch.tensor(top_p, dtype=torch.float32, device=logits.device))
        sub.masked_fill_(~keep, -math.inf)


def draw(probs: torch.Tensor, rows: list[RequestState]) -> torch.Tensor:
    """One token per row from probs [R, V] (non-negative weights, not necessarily normalised) by inverse
    transform (sampling_ops.draw_rows), u ~ Uniform[0, 1).

    One random number per row instead of one per token (the exponential race's V draws cost 60 ms for
    64 x 49k on two cores). Seeded rows draw u from their own generator, so their tokens depend only on seed
    and history; the others share one draw from the global RNG.
    """
    u = torch.empty(len(rows), device=probs.device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        u.uniform_()
    elif unseeded:
        u[torch.tensor(unseeded, device=probs.device)] = torch.rand(len(unseeded), device=probs.device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i:i + 1].uniform_(generator=row.generator)
    return draw_rows(probs, u)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]) -> list[SampledLogprobs]:
    """Per row: the top-num_logprobs entries (ranks 1..k), then token_ids[row] if not among them, with its
    rank = 1 + the number of tokens more likely than it."""
    vocab_size = logprobs.shape[1]
    top_logprobs, top_ids = logprobs.topk(min(max(num_logprobs, default=0), vocab_size), dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    token_ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    out = []
    for k, ids, lps, token_id, token_lp, rank in zip(num_logprobs, top_ids.tolist(), top_logprobs.tolist(),
                                                      token_ids.tolist(), token_logprobs.squeeze(1).tolist(),
                                                      token_ranks.tolist()):
        k = min(k, vocab_size)
        entry = SampledLogprobs(token_ids=ids[:k], logprobs=lps[:k], ranks=list(range(1, k + 1)))
        if token_id not in entry.token_ids:
            entry.token_ids.append(token_id)
            entry.logprobs.append(token_lp)
            entry.ranks.append(rank)
        out.append(entry)
    return out
