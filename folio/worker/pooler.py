"""Pooler: the vector of a pooling request, from the hidden states of its prompt (folio.pooling_params).

A prompt may be computed over several steps (chunked prefill), so mean pooling keeps a running sum per request
until the chunk that ends the prompt. A recomputation after a preemption starts again at position 0 and so
starts a fresh sum; the scheduler never serves a mean-pooled prompt from the prefix cache, so every position
passes through here.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from folio.pooling_params import PoolingParams


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # mean pooling: float32 sum of the positions computed so far

    def add_chunk(self, request_id: str, params: PoolingParams, hidden: torch.Tensor, first_position: int,
                  prompt_len: int) -> Optional[list[float]]:
        """Take the hidden states [num_tokens, hidden] of positions first_position on; the vector once the chunk
        ends the prompt, else None."""
        ends_prompt = first_position + hidden.shape[0] == prompt_len
        if params.pooling_type == "mean":
            total = hidden.float().sum(dim=0)
            if first_position > 0:
                total += self._sums.pop(request_id)
            if not ends_prompt:
                self._sums[request_id] = total
                return None
            vector = total / prompt_len
        elif ends_prompt:
            vector = hidden[-1].float()
        else:
            return None
        if params.normalize:
            vector = F.normalize(vector, dim=0)
        return vector.tolist()

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._sums.pop(request_id, None)
