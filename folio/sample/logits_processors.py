"""Logits processors: the changes made to a step's logits before a token is chosen, each applied in place to
only the rows that need it.

The sampler runs them in list order on its private float32 copy, after taking the raw logprobs (vLLM V1
reports those of the unprocessed distribution) and before temperature, min_p, top_k and top_p, which are the
sampler's own. These are the processors that can change the argmax (vLLM's non-argmax-invariant ones), so a
greedy request that uses one leaves the sampler's plain-argmax fast path. The default list, in vLLM's order:
allowed_token_ids, bad_words, logit_bias, min_tokens, then the repetition/frequency/presence penalties. A new
constraint on the choice of token (a grammar's token mask, say) is one more processor in this list; the sampler
does not change.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import Iterator

import torch

from folio.worker.request_state import RequestState


class LogitsProcessor(ABC):
    masks = False  # whether it forbids tokens outright (-inf): the sampler checks such rows keep some token

    @abstractmethod
    def applies(self, request: RequestState) -> bool:
        """Whether this request's row needs this processor in this step (called once per row and step)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        """Change logits[rows[i]], the row of requests[i], in place; the other rows must stay untouched."""


def _index(row_ids: list[int], token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device))


class AllowedTokenIds(LogitsProcessor):
    """vLLM's allowed_token_ids: every other token is forbidden."""

    masks = True

    def applies(self, request: RequestState) -> bool:
        return request.params.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        for request in requests:
            if request.forbidden is None:  # (a list as long as the vocabulary costs milliseconds to convert)
                allowed = [t for t in request.params.allowed_token_ids if t < logits.shape[1]]  # (checked at admission)
                request.forbidden = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
                request.forbidden[torch.tensor(allowed, dtype=torch.long, device=logits.device)] = False
        forbidden = torch.stack([request.forbidden for request in requests])  # (one op: a torch op a row costs ms)
        with rows_in_place(logits, rows) as sub:
            sub.masked_fill_(forbidden, -math.inf)


class BadWords(LogitsProcessor):
    """vLLM's bad_words, as token sequences (SamplingParams.bad_words_token_ids): a word's last token is forbidden
    wherever the output so far ends with the word's other tokens (a one-token word's, always). So the output never
    completes a bad word, however the model reaches its last token."""

    masks = True

    def applies(self, request: RequestState) -> bool:
        return bool(request.params.bad_words_token_ids)

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row, request in zip(rows, requests):
            output = request.output_token_ids
            for *start, last in request.params.bad_words_token_ids:
                if last < logits.shape[1] and len(output) >= len(start) and \
                        output[len(output) - len(start):] == start:
                    row_ids.append(row)
                    token_ids.append(last)
        if row_ids:
            logits[_index(row_ids, token_ids, logits.device)] = -math.inf


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: add a fixed value to given tokens."""

    def applies(self, request: RequestState) -> bool:
        return bool(request.params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        vocab_size = logits.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for row, request in zip(rows, requests):
            for token_id, bias in request.params.logit_bias.items():
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
                row_ids.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        logits.index_put_(_index(row_ids, token_ids, logits.device),
                          torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


class MinTokens(LogitsProcessor):
    """Forbid the stop tokens (EOS included unless ignore_eos) until min_tokens tokens are generated."""

    masks = True

    def applies(self, request: RequestState) -> bool:
        return len(request.output_token_ids) < request.params.min_tokens and bool(request.stop_token_ids)

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        vocab_size = logits.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row, request in zip(rows, requests):
            held = [t for t in request.stop_token_ids if 0 <= t < vocab_size]  # others cannot be sampled anyway
            row_ids += [row] * len(held)
            token_ids += held
        if row_ids:
            logits[_index(row_ids, token_ids, logits.device)] = -math.inf


class Penalties(LogitsProcessor):
    """Repetition penalty over prompt + output (Transformers' rule: divide positive logits, multiply negative
    ones), then OpenAI's frequency and presence penalties over the output only."""

    def applies(self, request: RequestState) -> bool:
        p = request.params
        return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        device = logits.device
        repetition = [r.params.repetition_penalty for r in requests]
        frequency = [r.params.frequency_penalty for r in requests]
        presence = [r.params.presence_penalty for r in requests]
        with rows_in_place(logits, rows) as sub:  # a neutral value leaves a row bit-identical
            if any(p != 1.0 for p in repetition):
                seen = _token_counts([r.prompt_token_ids + r.output_token_ids if p != 1.0 else []
                                      for r, p in zip(requests, repetition)], sub.shape[1], device) > 0
                penalty = torch.where(seen, torch.tensor(repetition, device=device).unsqueeze(1), 1.0)
                sub.copy_(torch.where(sub > 0, sub / penalty, sub * penalty))
            if any(frequency) or any(presence):
                counts = _token_counts([r.output_token_ids if f or p else []
                                        for r, f, p in zip(requests, frequency, presence)], sub.shape[1], device)
                sub -= torch.tensor(frequency, device=device).unsqueeze(1) * counts
                sub -= torch.tensor(presence, device=device).unsqueeze(1) * (counts > 0)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts via one scatter_add; lists are padded with id V, a sink column dropped at the end."""
    width = max(map(len, token_lists))
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    if width:
        padded = torch.tensor([t + [vocab_size] * (width - len(t)) for t in token_lists], device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


@contextlib.contextmanager
def rows_in_place(logits: torch.Tensor, row_ids: list[int]) -> Iterator[torch.Tensor]:
    """The given rows (ascending) to modify in place: logits itself when that is all of them (no [R, V]
    copies, which at 64 x 151936 cost more than the arithmetic), else a gathered copy written back afterwards."""
    if len(row_ids) == logits.shape[0]:
        yield logits
        return
    index = torch.tensor(row_ids, device=logits.device)
    sub = logits[index]
    yield sub
    logits[index] = sub


def default_logits_processors() -> list[LogitsProcessor]:
    """vLLM's order: the masks first (allowed_token_ids, bad_words), then logit_bias, min_tokens (the two commute:
    a -inf stays -inf whatever is added) and the penalties."""
    return [AllowedTokenIds(), BadWords(), LogitBias(), MinTokens(), Penalties()]
