"""Recurrent state: what a hybrid model's non-attention layers (LFM2's short convolutions, Granite 4.0-H's Mamba2
mixers) carry from one token to the next, one fixed-size state per request and layer, where its attention layers
keep K/V in the paged cache.

The model runner owns the states: one tensor per state of each recurrent layer, with a row per request row of its
input batch (folio.worker.input_batch: a request keeps its row while it runs, so the row is its state's slot). A
request's state holds what its layers saw of its first num_computed_tokens tokens; a step that computes a request
from token 0 (its first step, or its first after a preemption, which drops the state with the KV: both are
recomputed) zeroes its rows first.

A state follows one request's tokens exactly, so it can be neither shared nor rolled back: a model with recurrent
layers runs without prefix caching (a cached prefix has K/V, not the states after it) and without speculative
decoding (rejected drafts would stay in the states). The engine sees to both (folio.engine.llm_engine).

States can be large (a Mamba2 layer's is [heads, head_dim, d_state] float32: 4 MiB a request and layer in
granite-4.0-h-small), so they come out of the KV cache's memory budget: the engine sizes max_num_seqs rows of them
before the blocks (`request_state_bytes`), and on the CPU their memory, like the cache's, becomes resident only as
rows are written (folio.memory.zeros_on_demand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from folio.memory import zeros_on_demand


@dataclass(frozen=True)
class StateSpec:
    """One state of a layer for one request, in a dtype of its own (a Mamba2 SSM state is float32 whatever the
    model's dtype, as Transformers keeps it); a plain shape stands for a state in the model's dtype."""

    shape: tuple[int, ...]
    dtype: Optional[torch.dtype] = None


StateShapes = dict[int, tuple[Union[tuple[int, ...], StateSpec], ...]]  # layer -> each of its states, for one request


def _specs(shapes: StateShapes, dtype: torch.dtype) -> dict[int, tuple[StateSpec, ...]]:
    return {layer: tuple(StateSpec(s.shape, s.dtype or dtype) if isinstance(s, StateSpec)
                         else StateSpec(tuple(s), dtype) for s in kinds) for layer, kinds in shapes.items()}


def request_state_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of one request's recurrent states in a model of this dtype (0 without recurrent layers): what each row
    of max_num_seqs takes out of the KV cache budget."""
    shapes = getattr(model, "recurrent_state_shapes", None)
    if shapes is None:
        return 0
    return sum(math.prod(spec.shape) * spec.dtype.itemsize
               for kinds in _specs(shapes(), dtype).values() for spec in kinds)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return zeros_on_demand(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)


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
        """dtype: the model's, that of the states whose spec names none."""
        self.device = device
        self.states = {layer: tuple(_zeros((num_rows, *spec.shape), spec.dtype, device) for spec in kinds)
                       for layer, kinds in _specs(shapes, dtype).items()}
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
        grown = {layer: tuple(_zeros((num_rows, *s.shape[1:]), s.dtype, self.device) for s in states)
                 for layer, states in self.states.items()}
        for layer, states in self.states.items():
            for new, old in zip(grown[layer], states):
                new[:self.num_rows] = old
        self.states, self.num_rows = grown, num_rows
