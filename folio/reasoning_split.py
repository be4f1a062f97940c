"""What a reasoning parser's splitter gives for each piece of one choice's output (folio.reasoning_parser), apart
from the parsers so that a family's splitter in a module of its own (folio.harmony_split) can give it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence


@dataclass
class ReasoningSplit:
    """What a piece of one choice's output adds to its reasoning and to its content."""

    reasoning: str = ""
    content: str = ""
    num_reasoning_tokens: int = 0  # the piece's tokens that are reasoning (its first ones, where reasoning leads)
    # Where the content's tokens are not all those after the reasoning's (harmony's headers and calls are neither's):
    # the positions among the piece's tokens of those that wrote the content the client gets.
    content_tokens: Optional[list[int]] = None

    def logprob_tokens(self, count: int, with_reasoning: bool) -> Sequence[int]:
        """The positions among the piece's `count` tokens of those whose logprobs go with the message: with its
        reasoning, every token where reasoning and content are one text split at tags (a think block, tags and all,
        as vLLM gives them), else the content's alone."""
        if self.content_tokens is not None:
            return self.content_tokens
        return range(count) if with_reasoning else range(self.num_reasoning_tokens, count)


class OutputSplitter(Protocol):
    """What splits one choice's output into reasoning and content (ReasoningSplitter, HarmonySplitter)."""

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningSplit:
        """The reasoning and content that `text` and its tokens (after what was fed before) let out; with `final`,
        everything."""
