"""What a reasoning parser's splitter gives for each piece of one choice's output (folio.reasoning_parser), apart
from the parsers so that a family's splitter in a module of its own (folio.harmony_split) can give it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass
class ReasoningSplit:
    """What a piece of one choice's output adds to its reasoning and to its content."""

    reasoning: str = ""
    content: str = ""
    num_reasoning_tokens: int = 0  # the piece's tokens that are reasoning (its first ones, where reasoning leads)


class OutputSplitter(Protocol):
    """What splits one choice's output into reasoning and content (ReasoningSplitter, HarmonySplitter)."""

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningSplit:
        """The reasoning and content that `text` and its tokens (after what was fed before) let out; with `final`,
        everything."""
