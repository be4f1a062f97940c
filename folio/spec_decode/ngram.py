"""N-gram proposer (prompt lookup decoding): when the last tokens of a request occurred earlier in its own
prompt or output, guess that what followed them then follows again. Pays when the answer repeats the prompt
(code editing, quoting, summaries with citations) or itself; proposes nothing otherwise, so it costs nothing
where it cannot help but one scan of the request's tokens per step."""

from __future__ import annotations

import numpy as np

from folio.spec_decode.proposer import Proposer, continuations
from folio.worker.request_state import RequestState


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[RequestState], tokens: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(tokens, max_drafts):
            found = continuations(seq, self.min_n, self.max_n)
            # the latest occurrence: the most recent context is the likeliest to repeat
            drafts.append(seq[found[-1]:found[-1] + k].tolist() if found.size else [])
        return drafts
