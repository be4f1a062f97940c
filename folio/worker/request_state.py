"""RequestState: all the model runner knows about one request, built from the step messages alone.

It is created from a NewRequestData and lives until the request appears in a SchedulerOutput's finished_ids,
across preemptions (so a seeded request's generator keeps its state, exactly as if it had not been preempted).
The runner appends each token it samples; the core appends the same tokens to its own Request when it reads
the runner's output, so the two views agree without sharing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from folio.core.step_contract import NewRequestData
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: Optional[SamplingParams]  # None for a pooling request
    stop_token_ids: frozenset[int]  # held back by min_tokens: EOS (unless ignore_eos) + params.stop_token_ids
    # Its own generator when params.seed is set, so its draws depend only on its seed and history; None draws
    # from the global RNG.
    generator: Optional[torch.Generator] = None
    output_token_ids: list[int] = field(default_factory=list)  # sampled so far
    pooling_params: Optional[PoolingParams] = None
    # Structured outputs: the tokens its grammar allows in this step's samples (rows of the SchedulerOutput's
    # grammar bitmask, set every step): row 0 for the token after its known ones, row j + 1 for the one after
    # its j + 1-th draft; None when its output is unconstrained.
    token_bitmasks: Optional[np.ndarray] = None
    # the tokens params.allowed_token_ids leave out, as a [V] mask made once (AllowedTokenIds)
    forbidden: Optional[torch.Tensor] = None

    @classmethod
    def from_new_request(cls, new: NewRequestData) -> "RequestState":
        seed = new.sampling_params.seed if new.sampling_params is not None else None
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return cls(new.request_id, new.prompt_token_ids, new.sampling_params, new.stop_token_ids, generator,
                   pooling_params=new.pooling_params)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_bitmask(self) -> Optional[np.ndarray]:
        """The grammar's mask of its next token (what GrammarTokenMask applies); None when unconstrained."""
        return None if self.token_bitmasks is None else self.token_bitmasks[0]
