"""ReasoningGate: where a constrained request's grammar starts under a reasoning parser (folio.reasoning_parser).

An output that starts in reasoning is free up to the closing tag, which its tokens complete; the grammar follows
the tokens after it. A model that opens the block itself (Magistral's `[THINK]`) can do so only at its first
token, since the grammar holds from there on: that token's mask is the grammar's tokens and the opening tag. The
tag starts the reasoning, and the grammar waits for the closing tag; any other token is the grammar's first.

Speculative decoding checks a step's drafts under one row per sampled position, so the gate tells, without
moving, where the drafts would take the request (`plan`); it follows only the tokens accepted (`takes`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from folio.reasoning_parser import EndTagWatcher


class StepPlan(NamedTuple):
    """The rows of a step's sampled positions (the next token, then one after each draft)."""

    grammar_from: Optional[int]  # the first position the grammar constrains; None when none is
    opening: Optional[int]  # a token the first position allows beside the grammar's (the opening tag), if any


class ReasoningGate:
    def __init__(self, end_tag_ids: tuple[int, ...], opening_id: Optional[int] = None) -> None:
        """`opening_id`: the opening tag's token, where the output starts in content and may open the block at
        its first token; None where it starts inside the block."""
        self._end_tag_ids = end_tag_ids
        self._opening_id = opening_id  # until the first token is sampled
        self._reasoning = EndTagWatcher(end_tag_ids) if opening_id is None else None

    def plan(self, draft_token_ids: list[int]) -> StepPlan:
        """The rows of this step, with these drafts."""
        if self._opening_id is not None:
            if draft_token_ids[:1] != [self._opening_id]:
                return StepPlan(0, self._opening_id)
            taken = EndTagWatcher(self._end_tag_ids).find(draft_token_ids[1:])
            return StepPlan(None if taken is None else 1 + taken, self._opening_id)
        if self._reasoning is None or self._reasoning.done:
            return StepPlan(0, None)
        return StepPlan(self._reasoning.find(draft_token_ids), None)

    def takes(self, token_id: int) -> bool:
        """Follow a sampled token: whether it is the reasoning's (the opening tag, and every token up to the
        closing tag's last), not the grammar's."""
        if self._opening_id is not None:
            opened, self._opening_id = token_id == self._opening_id, None
            self._reasoning = EndTagWatcher(self._end_tag_ids) if opened else None
            return opened
        if self._reasoning is None or self._reasoning.done:
            return False
        self._reasoning.feed([token_id])
        return True
