"""Proposer: guesses the tokens that follow each request's last one (the drafts), for the target to verify.

Proposers run beside the model runner, after each step's sampling, on the runner's own per-request state;
they never change it. `propose` gets each request's tokens so far (prompt + output, a read-only numpy view
of the runner's token row) and how many drafts it may return (possibly fewer, or none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from folio.worker.request_state import RequestState


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[RequestState], tokens: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        """Drafts for each request, at most max_drafts[i] for requests[i], whose tokens so far are tokens[i]."""

    def finished(self, request: RequestState) -> None:
        """A request ended (proposers that learn from past requests keep its output)."""

    def preempted(self, request_id: str) -> None:
        """A request lost its blocks (and whatever a proposer kept in them); it is computed again later."""


def continuations(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """Where the longest suffix of `tokens`, of min_n to max_n tokens, occurred before: the positions right after
    each earlier occurrence (its continuations), ascending; empty when not even min_n tokens recur.

    Narrows the occurrences of the last token by one more token at a time, so the cost is a scan for the last
    token plus work proportional to how often it occurs. Negative ids never match a token (separators).
    """
    end = len(tokens)
    if end < min_n + 1:
        return np.empty(0, dtype=np.int64)
    found = np.flatnonzero(tokens[:end - 1] == tokens[end - 1]) + 1
    n = 1
    while n < max_n and found.size:
        longer = found[found > n]
        longer = longer[tokens[longer - n - 1] == tokens[end - n - 1]]
        if not longer.size:
            break
        found, n = longer, n + 1
    return found if n >= min_n else np.empty(0, dtype=np.int64)
