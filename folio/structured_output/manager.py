"""StructuredOutputManager: the engine core's side of structured outputs.

- `validate` checks a constraint when its request is added, so a bad one fails before anything is queued. The
  server checks it first (to name the field that carried it), then the engine as the request is added: the
  manager remembers the constraints found valid, so each is validated once on its way in.
- `add_requests` starts compiling on a worker thread (llguidance releases the GIL), through a cache keyed by the
  constraint: requests with the same schema (the n samples of one request, or clients repeating a schema) share
  one compile and each copies the result. The scheduler skips a request whose grammar is still compiling and
  admits the ones behind it.
- `grammar_bitmask` builds each step's token bitmask for the constrained requests that sample in it (one row per
  sampled position), which travels to the model runner in the SchedulerOutput. Unconstrained requests get no
  row and pay nothing, nor do constrained ones still reasoning (under a reasoning parser, a request whose prompt
  leaves it reasoning is constrained from the token after the closing tag on; where the model opens the block
  itself, the first token's row also allows the opening tag: folio.structured_output.reasoning_gate; a parser whose
  grammars write the reasoning themselves, GPT-OSS's harmony, has no gate).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from folio.config import StructuredOutputsOptions
from folio.core.request import Request
from folio.core.step_contract import GrammarBitmask, SchedulerOutput
from folio.reasoning_parser import reasoning_parser
from folio.structured_output.backend import (BitmaskFill, Grammar, StructuredOutputBackend, allow_token,
                                             bitmask_width)
from folio.structured_output.params import DESCRIPTIONS, StructuredOutputsParams
from folio.structured_output.reasoning_gate import ReasoningGate
from folio.structured_output.request import StructuredOutputRequest
from folio.tokenizer import Tokenizer

logger = logging.getLogger("folio")

CACHE_SIZE = 256  # compiled grammars, and keys of valid constraints, kept (least recently used dropped first)


@dataclass
class StructuredOutputStats:
    """Counters since start, for benchmarks and metrics."""

    num_compiles: int = 0
    num_cache_hits: int = 0
    compile_s: float = 0.0  # on the compile thread
    num_bitmask_steps: int = 0  # steps that had constrained rows
    num_bitmask_rows: int = 0
    bitmask_s: float = 0.0  # on the step loop, filling those rows


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> StructuredOutputBackend:
    """The backend the structured_outputs_backend option names (folio.config checks the name)."""
    from folio.structured_output.llguidance_backend import LLGuidanceBackend

    return {"llguidance": LLGuidanceBackend}[name](tokenizer, vocab_size, eos_token_ids)


class StructuredOutputManager:
    def __init__(self, options: StructuredOutputsOptions, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        # The model's logits may have padding rows past the tokenizer's ids, or (rarely) the tokenizer ids past the
        # logits: the grammar's vocabulary covers both; ids past the logits are never sampled anyway.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.backend = make_backend(options.structured_outputs_backend, tokenizer, self.vocab_size, eos_token_ids)
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser(options.reasoning_parser)
        if self.reasoning_parser is not None:
            self.reasoning_parser.check(tokenizer)
        # One thread: compiles are rare next to steps, and one thread makes the lazily built tokenizer safe.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="folio-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        # Keys of constraints found valid. The server validates on its event loop, the engine on its thread.
        self._valid: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._valid_lock = threading.Lock()
        self.stats = StructuredOutputStats()

    def validate(self, params: Optional[StructuredOutputsParams], field: Optional[str] = None) -> None:
        """ValueError naming `field` (default: structured_outputs.<kind>) if the constraint is invalid."""
        if params is None:
            return
        key = params.key()
        with self._valid_lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return
        try:
            self.backend.validate(params)
        except ValueError as e:
            raise ValueError(f"{field or 'structured_outputs.' + params.kind} is not a valid "
                             f"{DESCRIPTIONS[params.kind]}: {e}") from None
        with self._valid_lock:
            self._valid[key] = None
            if len(self._valid) > CACHE_SIZE:
                self._valid.popitem(last=False)

    def add_requests(self, requests: list[Request]) -> None:
        """Start compiling the (validated) grammars of new requests."""
        for request in requests:
            params = request.sampling_params.structured_outputs
            if params is not None:
                request.structured_output = StructuredOutputRequest(
                    request.request_id, self._compiled(params), self._reasoning_gate(request.prompt_token_ids))

    def _reasoning_gate(self, prompt_token_ids: list[int]) -> Optional[ReasoningGate]:
        """Where the grammar of a request with this prompt starts; None: at its first token."""
        parser, tokenizer = self.reasoning_parser, self.tokenizer
        if parser is None or parser.frames_grammars:
            return None
        end = parser.end_tag_ids(tokenizer)
        if parser.starts_in_reasoning(tokenizer, prompt_token_ids):
            return ReasoningGate(end)
        return ReasoningGate(end, parser.start_tag_ids(tokenizer)[0]) if parser.model_opens else None

    def _compiled(self, params: StructuredOutputsParams) -> "Future[Grammar]":
        key = params.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.num_cache_hits += 1
            return future
        future = self._cache[key] = self._compiler.submit(self._compile, params)
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        start = time.perf_counter()
        try:
            return self.backend.compile(params)
        except Exception:
            logger.exception("compiling the %s of a request failed", DESCRIPTIONS[params.kind])
            raise
        finally:
            self.stats.num_compiles += 1
            self.stats.compile_s += time.perf_counter() - start

    def grammar_bitmask(self, out: SchedulerOutput, requests: dict[str, Request]) -> Optional[GrammarBitmask]:
        """The bitmask of the constrained requests that sample in this step, or None when there are none."""
        fills: list[BitmaskFill] = []
        openings: list[tuple[int, int, int]] = []  # (a first position's row, the grammar's start row, a token)
        rows: dict[str, int] = {}
        num_rows = 0
        for item in out.scheduled:
            request = requests[item.request_id]
            so = request.structured_output
            if so is None or item.num_computed_tokens + item.num_tokens < request.num_tokens:
                continue  # unconstrained, or a prompt chunk that does not reach the end yet
            grammar_from, opening = so.plan(item.draft_token_ids)
            if grammar_from is None and opening is None:
                continue  # still reasoning after every draft
            grammar = so.grammar
            if grammar is None:
                continue  # compiling failed: its first token aborts it (StructuredOutputRequest.advance)
            rows[item.request_id] = num_rows  # the free positions' rows stay all ones
            # With the opening tag drafted first and no closing tag after it, only the first row is the grammar's.
            first = grammar_from or 0
            fills.append(BitmaskFill(grammar, num_rows + first,
                                     item.draft_token_ids[first:] if grammar_from is not None else []))
            if opening is not None:  # (the grammar has taken no token: the row it starts at is the first's too)
                openings.append((num_rows, num_rows + first, opening))
            num_rows += 1 + len(item.draft_token_ids)
        if not fills:
            return None
        start = time.perf_counter()
        bitmask = np.full((num_rows, bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        self.backend.fill_bitmask(fills, bitmask)
        for row, grammar_row, token_id in openings:
            bitmask[row] = bitmask[grammar_row]
            allow_token(bitmask[row], token_id)
        self.stats.num_bitmask_steps += 1
        self.stats.num_bitmask_rows += num_rows
        self.stats.bitmask_s += time.perf_counter() - start
        return GrammarBitmask(rows, bitmask)
