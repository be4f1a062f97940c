"""PoolingParams: how a prompt becomes one vector (an embedding) instead of a continuation, in vLLM's names.

A request with PoolingParams runs its prompt through the model and ends there: nothing is sampled. Its vector is
the final (normed) hidden state of the last prompt token, which in a causal model is the only position that
has seen the whole prompt ("last"), or the average over every prompt position ("mean"); then scaled to unit
length unless `normalize` is off. A causal LM was not trained for this: its embeddings are a convenience, not
those of a trained embedding model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from folio.sampling_params import check_truncate_prompt_tokens

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    pooling_type: str = "last"
    normalize: bool = True
    truncate_prompt_tokens: Optional[int] = None  # the prompt's last k tokens (-1: as many as fit beside one more)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads the hidden state of every prompt position, so none may come from the prefix cache."""
        return self.pooling_type == "mean"
