"""StructuredOutputRequest: a core request's grammar, kept on the engine-core side with the request itself.

The matcher lives next to the Request in the scheduler, not in the model runner, so it survives preemption with
nothing to rebuild: a preempted request keeps its output tokens (its KV is recomputed, its tokens are not
resampled), and its matcher has accepted exactly those tokens. The runner only ever sees bitmask rows.

Under a reasoning parser the grammar waits for the reasoning to end: the tokens up to the closing tag are free,
and the grammar follows the tokens after it (folio.structured_output.reasoning_gate).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Optional

from folio.core.request import RequestStatus
from folio.structured_output.backend import Grammar
from folio.structured_output.reasoning_gate import ReasoningGate, StepPlan

logger = logging.getLogger("folio")


class StructuredOutputRequest:
    def __init__(self, request_id: str, compiled: "Future[Grammar]",
                 reasoning: Optional[ReasoningGate] = None) -> None:
        self.request_id = request_id
        self._compiled = compiled  # the cache's shared grammar at its start, being compiled or done
        self._grammar: Optional[Grammar] = None
        self.reasoning = reasoning  # where the grammar starts; None: at the first token

    def plan(self, draft_token_ids: list[int]) -> StepPlan:
        """Which of this step's sampled positions (the next token, then one after each draft) the grammar
        constrains."""
        return StepPlan(0, None) if self.reasoning is None else self.reasoning.plan(draft_token_ids)

    @property
    def ready(self) -> bool:
        """Whether the grammar has compiled (or failed to): until then the request waits, out of the way."""
        return self._compiled.done()

    @property
    def grammar(self) -> Optional[Grammar]:
        """This request's own matcher, copied from the compiled grammar at first use; None if compiling failed."""
        if self._grammar is None and self._compiled.exception() is None:
            self._grammar = self._compiled.result().copy()
        return self._grammar

    def advance(self, token_id: int) -> Optional[RequestStatus]:
        """Follow a sampled token: FINISHED_STOPPED once the grammar accepted EOS (ignore_eos or not), and
        FINISHED_ABORTED if the token breaks the grammar (under the mask it cannot, unless compiling failed; the
        other processors never empty a row: min_tokens, allowed_token_ids and bad_words, which could, are refused
        with structured outputs). Tokens of the reasoning pass freely."""
        if self.reasoning is not None and self.reasoning.takes(token_id):
            return None
        grammar = self.grammar
        if grammar is None or not grammar.accept_tokens([token_id]):
            reason = "its grammar did not compile" if grammar is None else f"token {token_id} breaks its grammar"
            logger.error("request %s: %s; aborting it", self.request_id, reason)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated() else None
