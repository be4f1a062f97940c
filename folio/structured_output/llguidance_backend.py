"""The llguidance backend (shared/design/dependencies-study.md section 1: no dependencies, masks in tens of
microseconds, rollback, parallel mask filling that releases the GIL).

The LLTokenizer (about 1 s for a 49k vocabulary) is built on first compile, on the compile thread, so engines
that never see a constrained request never pay for it. JSON is compiled with fixed separators (", " and ": ",
as json.dumps writes) and no free whitespace: a small model otherwise may write newlines forever.
"""

from __future__ import annotations

import json
from functools import cached_property

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from folio.structured_output.backend import BitmaskFill, Grammar, StructuredOutputBackend
from folio.structured_output.params import StructuredOutputsParams
from folio.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; ValueError when it cannot even be converted (bad GBNF)."""
    kind, spec = params.kind, params.spec
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec if kind == "json" else ANY_JSON_OBJECT,
                                                             defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec))
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


class LLGuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self._num_tokens = 0
        self._eos_at = None  # how many tokens had been accepted once EOS was: the output is complete

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if not self.matcher.consume_token(token_id):
                return False
            self._num_tokens += 1
            if token_id in self.eos_token_ids:
                self._eos_at = self._num_tokens
        return True

    def rollback(self, num_tokens: int) -> None:
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.matcher.get_error()}")
        self._num_tokens -= num_tokens
        if self._eos_at is not None and self._eos_at > self._num_tokens:
            self._eos_at = None

    def is_terminated(self) -> bool:
        return self._eos_at is not None

    def copy(self) -> "LLGuidanceGrammar":
        twin = LLGuidanceGrammar(self.matcher.deep_copy(), self.eos_token_ids)
        twin._num_tokens, twin._eos_at = self._num_tokens, self._eos_at
        return twin


class LLGuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built by the first compile; compiles run on one thread (StructuredOutputManager), so only once."""
        return llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                      eos_token=sorted(self.eos_token_ids))

    @cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def validate(self, params: StructuredOutputsParams) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
        if error:
            raise ValueError(error.strip())

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return LLGuidanceGrammar(matcher, self.eos_token_ids)

    def fill_bitmask(self, fills: list[BitmaskFill], bitmask: np.ndarray) -> None:
        plain = [(f.grammar.matcher, f.row) for f in fills if not f.draft_token_ids]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        drafts = [(f.grammar.matcher, f.row, f.draft_token_ids) for f in fills if f.draft_token_ids]
        if drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafts, bitmask)
