"""Recurrent state: what a hybrid model's non-attention layers (LFM2's short convolutions) carry from one token to
the next, one fixed-size state per request and layer, where its attention layers keep K/V in the paged cache.

The model runner owns the states: one tensor per state of each recurrent layer, with a row per request row of its
input batch (folio.worker.input_batch: a request keeps its row while it runs, so the row is its state's slot). A
request's state holds what its layers saw of its first num_computed_tokens tokens; a step that computes a request
from token 0 (its first step, or its first after a preemption, which drops the state with the KV: both are
recomputed) zeroes its rows first.

A state follows one request's tokens exactly, so it can be neither shared nor rolled back: a model with recurrent
layers runs without prefix caching (a cached prefix has K/V, not the states after it) and without speculative
decoding (rejected drafts would stay in the states). The engine sees to both (folio.engine.llm_engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

StateShapes = dict[int, tuple[tuple[int, ...], ...]]  # layer -> the shape of each of its states, for one request


@dataclass
class RecurrentStep:
    """A step's view for the recurrent layers: their states, and the step's requests' rows in batch order with the
    tokens each computes (a request's tokens follow one another in the flattened batch)."""

    states: dict[int, tuple[torch.Tensor, ...]]  # layer -> its states, [rows, *shape] each
    rows: torch.Tensor  # [B] int64
    query_lens: list[int]

    @property
    def decodes_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class RecurrentStates:
    def __init__(self, shapes: StateShapes, num_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.states = {layer: tuple(torch.zeros(num_rows, *shape, dtype=dtype, device=device) for shape in kinds)
                       for layer, kinds in shapes.items()}
        self.num_rows = num_rows

    def step(self, rows: np.ndarray, fresh: Sequence[bool], query_lens: Sequence[int]) -> RecurrentStep:
        """The step's view, after zeroing the rows of the requests it computes from token 0 (fresh)."""
        if int(rows.max()) >= self.num_rows:  # the input batch grew past max_num_seqs rows: grow alike
            self._grow(int(rows.max()) + 1)
        index = torch.from_numpy(rows).to(self.device)
        reset = index[torch.tensor(list(fresh), dtype=torch.bool)]
        if len(reset):
            for states in self.states.values():
                for state in states:
                    state[reset] = 0
        return RecurrentStep(self.states, index, list(query_lens))

    def _grow(self, num_rows: int) -> None:
        self.states = {layer: tuple(torch.cat([s, s.new_zeros(num_rows - self.num_rows, *s.shape[1:])]) for s in states)
                       for layer, states in self.states.items()}
        self.num_rows = num_rows
