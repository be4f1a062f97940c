"""Suffix proposer (after Arctic Inference's suffix decoding): the request's last tokens are looked up in its
own tokens and in the outputs of recent requests; the drafts follow the continuations those occurrences agree
on, token by token, as a walk down a suffix tree weighted by frequency would.

Where n-gram lookup copies the single latest occurrence of the request's own context, this counts every
occurrence, in this request and across requests, and stops guessing where they stop agreeing. It pays on
agent loops and code editing, whose outputs repeat what earlier requests wrote.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from folio.spec_decode.proposer import Proposer, continuations
from folio.worker.request_state import RequestState

SEPARATOR = np.array([-1], dtype=np.int32)  # between requests in the corpus: matches nothing
MIN_AGREEMENT = 0.5  # a draft token needs more than this share of the occurrences still followed


class SuffixProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, cache_requests: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.recent: deque[np.ndarray] = deque(maxlen=cache_requests)  # outputs of finished requests
        self._corpus: np.ndarray = np.empty(0, dtype=np.int32)
        self._stale = False

    def finished(self, request: RequestState) -> None:
        if request.output_token_ids:
            self.recent.append(np.asarray(request.output_token_ids, dtype=np.int32))
            self._stale = True

    def propose(self, requests: list[RequestState], tokens: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        if self._stale:
            self._corpus = np.concatenate([part for out in self.recent for part in (out, SEPARATOR)] or [SEPARATOR])
            self._stale = False
        return [self._walk(np.concatenate([self._corpus, seq]), k) for seq, k in zip(tokens, max_drafts)]

    def _walk(self, corpus: np.ndarray, k: int) -> list[int]:
        """Follow the occurrences of the corpus's suffix forward while most of them agree on the next token."""
        end = len(corpus)
        found = continuations(corpus, self.min_n, self.max_n)
        drafts: list[int] = []
        while found.size and len(drafts) < k:
            found = found[found < end]
            nxt = corpus[found]
            found, nxt = found[nxt >= 0], nxt[nxt >= 0]
            if not found.size:
                break
            values, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            if counts[best] <= MIN_AGREEMENT * found.size:
                break
            drafts.append(int(values[best]))
            found = found[nxt == values[best]] + 1
        return drafts
