"""The interface a grammar library implements to serve structured outputs (llguidance today; xgrammar could be
another): validate a constraint, compile it for the model's tokenizer, and per request a Grammar that follows the
tokens and writes which tokens may come next into a bitmask.

Bitmask layout (as llguidance's and xgrammar's): int32 [rows, ceil(vocab_size / 32)], token t allowed in a row
iff bit t % 32 of word t // 32 is set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from folio.structured_output.params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allow_token(row: np.ndarray, token_id: int) -> None:
    """Set a token's bit in a bitmask row (in place)."""
    row.view(np.uint32)[token_id // 32] |= np.uint32(1 << (token_id % 32))


class Grammar(ABC):
    """One request's matcher: the state of the grammar after the tokens it accepted so far."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False if one is not allowed (the grammar is then in error)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forget the last accepted tokens (speculative decoding: drafts the target model rejected)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted EOS: it is complete and the request's output is done."""

    @abstractmethod
    def copy(self) -> "Grammar":
        """An independent matcher in the same state (a cached compiled grammar is copied for each request)."""


@dataclass
class BitmaskFill:
    """Rows `row`, row + 1, ... of a bitmask for one grammar: the tokens allowed next, then after each draft token
    in turn (one row per draft, for the position that follows it), the grammar left as it was."""

    grammar: Grammar
    row: int
    draft_token_ids: list[int]


class StructuredOutputBackend(ABC):
    """A grammar library bound to one tokenizer. `compile` may be slow: the manager runs it off the step loop."""

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError saying what is wrong with the constraint (cheap: called before a request is queued)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A matcher at the start of the constraint."""

    @abstractmethod
    def fill_bitmask(self, fills: list[BitmaskFill], bitmask: np.ndarray) -> None:
        """Write the allowed tokens of each fill's rows; other rows are left as they are."""
