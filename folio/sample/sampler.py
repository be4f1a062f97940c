"""Batched sampler: one call turns a [B, V] logits batch into one token per request, in vLLM V1's order.

Order (vLLM V1): raw logprobs -> logit_bias, min_tokens -> repetition/frequency/presence penalties ->
greedy argmax, or temperature -> min_p -> top_k -> top_p -> inverse-transform sampling.
Every step is a batched tensor op over the rows that need it; a row that does not use a processor gets a
neutral value (penalty 1, frequency 0, min_p 0) or is left out (top_k, top_p), so its numbers never depend
on its neighbours and a seeded request's tokens depend only on its seed and its own history.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from folio.sample.sampling_ops import argmax_rows, draw_rows, top_p_mask
from folio.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits batch: a request that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    # The request's own generator when params.seed is set (it owns it, so its state persists across
    # steps); None draws from the global RNG.
    generator: Optional[torch.Generator]
    stop_token_ids: set[int]  # held back by min_tokens: EOS (unless ignore_eos) + params.stop_token_ids


@dataclass
class SampledLogprobs:
    """Top-k tokens of one position, then the chosen token if it is not among them."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank in the whole vocabulary


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[Optional[SampledLogprobs]]  # None for rows without params.logprobs


class Sampler:
    """Stateless: all per-request state (history, generator) comes in with the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        plain = [i for i, r in enumerate(rows) if _is_plain_greedy(r)]
        if len(plain) == len(rows):  # the common case: read the model's logits once, copy nothing
            return SamplerOutput(sampled_token_ids=argmax_rows(logits).tolist(), logprobs=[None] * len(rows))
        if not plain:
            return self._sample(logits, rows)
        # a mixed batch: plain greedy rows take the fast path, the others the full one
        others = sorted(set(range(len(rows))) - set(plain))
        fast = argmax_rows(logits[torch.tensor(plain, device=logits.device)]).tolist()
        full = self._sample(logits[torch.tensor(others, device=logits.device)], [rows[i] for i in others])
        tokens: list[int] = [0] * len(rows)
        logprobs: list[Optional[SampledLogprobs]] = [None] * len(rows)
        for i, token in zip(plain, fast):
            tokens[i] = token
        for i, token, lp in zip(others, full.sampled_token_ids, full.logprobs):
            tokens[i], logprobs[i] = token, lp
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The full path: raw logprobs, logits processors, greedy or random choice."""
        # A private float32 copy: processors work in place and the caller's tensor stays untouched.
        logits = logits.to(torch.float32, copy=True)
        device = logits.device

        # vLLM V1 reports logprobs of the model's raw distribution, so take them before any processing.
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if lp_rows:
            lp_index = torch.tensor(lp_rows, dtype=torch.long, device=device)
            raw_logprobs = torch.log_softmax(logits[lp_index], dim=-1)

        _process_logits(logits, rows)

        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if len(random_rows) == len(rows):
            sampled = _sample_random(logits, rows)  # logits is private: modified in place, no copy
        else:
            sampled = argmax_rows(logits)  # the answer for greedy rows; random rows are overwritten below
            if random_rows:
                index = torch.tensor(random_rows, dtype=torch.long, device=device)
                sampled[index] = _sample_random(logits[index], [rows[i] for i in random_rows])

        logprobs: list[Optional[SampledLogprobs]] = [None] * len(rows)
        if lp_rows:
            gathered = _gather_logprobs(raw_logprobs, sampled[lp_index], [rows[i].params.logprobs for i in lp_rows])
            for i, entry in zip(lp_rows, gathered):
                logprobs[i] = entry
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy, and nothing that needs the float32 copy: no logprobs, no processor that changes a logit."""
    p = row.params
    return (p.is_greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty
            and (len(row.output_token_ids) >= p.min_tokens or not row.stop_token_ids))


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: list[int],
                            num_logprobs: int) -> list[SampledLogprobs]:
    """Logprobs of each prompt token under the raw logits of the position before it (logits[i] -> target i)."""
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(f"logits must be [len(target_token_ids)={len(target_token_ids)}, V], "
                         f"got {tuple(logits.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_token_ids, dtype=torch.long, device=logits.device)
    return _gather_logprobs(logprobs, targets, [num_logprobs] * len(target_token_ids))


def _process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: logit_bias, min_tokens, then penalties — the steps that can change the argmax."""
    _apply_logit_bias(logits, rows)
    _apply_min_tokens(logits, rows)
    _apply_penalties(logits, rows)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
            row_ids.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if row_ids:
        logits.index_put_(_index(row_ids, token_ids, logits.device),
                          torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid stop tokens until min_tokens are generated; ids outside the vocabulary cannot be sampled anyway."""
    vocab_size = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            held = [t for t in row.stop_token_ids if 0 <= t < vocab_size]
            row_ids += [i] * len(held)
            token_ids += held
    if row_ids:
        logits[_index(row_ids, token_ids, logits.device)] = -math.inf


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition over prompt + output (HF rule), then OpenAI frequency/presence over output only."""
    device = logits.device
    repetition = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in repetition):
        seen = _token_counts([r.prompt_token_ids + r.output_token_ids if p != 1.0 else []
                              for r, p in zip(rows, repetition)], logits.shape[1], device) > 0
        penalty = torch.where(seen, torch.tensor(repetition, device=device).unsqueeze(1), 1.0)
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))

    frequency = [r.params.frequency_penalty for r in rows]
    presence = [r.params.presence_penalty for r in rows]
    if any(frequency) or any(presence):
        counts = _token_counts([r.output_token_ids if f or p else []
                                for r, f, p in zip(rows, frequency, presence)], logits.shape[1], device)
        logits -= torch.tensor(frequency, device=device).unsqueeze(1) * counts
        logits -= torch.tensor(presence, device=device).unsqueeze(1) * (counts > 0)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts via one scatter_add; lists are padded with id V, a sink column dropped at the end."""
    width = max(map(len, token_lists))
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    if width:
        padded = torch.tensor([t + [vocab_size] * (width - len(t)) for t in token_lists], device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sample one token per (non-greedy) row; logits is a private [R, V] tensor, modified in place."""
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
    return _draw(logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_(), rows)


def _apply_top_k(logits: torch.Tensor, row_ids: list[int], top_k: list[int]) -> None:
    """In place on the given rows: drop tokens below the k-th largest value (ties with it stay).

    topk(max k) instead of a full-vocabulary sort; the k-th value itself is unique, so the result does
    not depend on how topk orders ties or on the other rows' k.
    """
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    with _rows(logits, row_ids) as sub:
        kth = sub.topk(max(top_k), dim=-1).values.gather(1, k - 1)
        sub.masked_fill_(sub < kth, -math.inf)


def _apply_top_p(logits: torch.Tensor, row_ids: list[int], top_p: list[float]) -> None:
    """In place on the given rows: keep the smallest most-likely-first set whose mass reaches top_p
    (sampling_ops.top_p_mask: no sort of the vocabulary; it depends only on the row's own logits)."""
    with _rows(logits, row_ids) as sub:
        keep = top_p_mask(sub.softmax(dim=-1), torch.tensor(top_p, dtype=torch.float32, device=logits.device))
        sub.masked_fill_(~keep, -math.inf)


@contextlib.contextmanager
def _rows(logits: torch.Tensor, row_ids: list[int]) -> Iterator[torch.Tensor]:
    """The given rows to modify in place: logits itself when that is all of them (no [R, V] copies, which at
    64 x 151936 cost more than the arithmetic), else a gathered copy written back afterwards."""
    if len(row_ids) == logits.shape[0]:
        yield logits
        return
    index = torch.tensor(row_ids, device=logits.device)
    sub = logits[index]
    yield sub
    logits[index] = sub


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]) -> list[SampledLogprobs]:
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


def _index(row_ids: list[int], token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device))
