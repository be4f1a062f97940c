"""Beam search, run above the engine as vLLM does since V1: each step, every live beam is one single-token
request asking for its top 2 * beam_width logprobs; the best beam_width extensions survive.

Beams of one prompt share their common prefix through the prefix cache, so a step computes only what is
new in each beam (its last partial block and token), never the whole prompt again. The search itself
(`BeamSearch`) knows nothing of how requests run: the offline API drives it with LLMEngine's step loop,
the server with AsyncLLM.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from folio.engine.input_processor import MAX_LOGPROBS
from folio.engine.output_processor import OutputKind
from folio.outputs import Logprob
from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from folio.engine.async_llm import AsyncLLM
    from folio.engine.llm_engine import LLMEngine
    from folio.tokenizer import Tokenizer


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # finished beams are ranked by cum_logprob / len(tokens) ** length_penalty

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_LOGPROBS // 2):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens (prompt excluded)
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: Optional[str] = None

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.tokens), 1) ** length_penalty


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


class BeamSearch:
    """The search state of a batch of prompts: which beams to expand next, and what expanding them gave."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        self.prompts, self.params, self.eos = prompts, params, eos_token_ids
        self.live = [[BeamSearchSequence([])] for _ in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.step = 0
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width,
                                          ignore_eos=True)
        self._ids = itertools.count()
        self._pending: dict[str, tuple[int, BeamSearchSequence]] = {}

    @property
    def finished(self) -> bool:
        return self.step >= self.params.max_tokens or not any(self.live)

    def requests(self) -> list[tuple[str, dict]]:
        """(request_id, prompt) of every beam to expand this step."""
        self._pending = {}
        for p, beams in enumerate(self.live):
            for beam in beams:
                rid = f"beam-{next(self._ids)}"
                self._pending[rid] = (p, beam)
        return [(rid, {"prompt_token_ids": self.prompts[p] + beam.tokens}) for rid, (p, beam) in self._pending.items()]

    def advance(self, top_logprobs: dict[str, dict[int, Logprob]]) -> None:
        """Extend every beam by its candidates and keep the best beam_width per prompt."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for rid, (p, beam) in self._pending.items():
            for token, lp in top_logprobs[rid].items():
                candidates[p].append(BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp.logprob))
        self.step += 1
        last = self.step == self.params.max_tokens
        for p, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            survivors = []
            for cand in cands[:2 * self.params.beam_width]:
                if not self.params.ignore_eos and cand.tokens[-1] in self.eos:
                    cand.finish_reason = "stop"
                    self.done[p].append(cand)
                elif len(survivors) < self.params.beam_width:
                    survivors.append(cand)
            if last:
                for beam in survivors:
                    beam.finish_reason = "length"
                self.done[p].extend(survivors)
                survivors = []
            self.live[p] = survivors

    def outputs(self, tokenizer: "Tokenizer") -> list[BeamSearchOutput]:
        results = []
        for prompt, finished in zip(self.prompts, self.done):
            best = sorted(finished, key=lambda s: s.score(self.params.length_penalty), reverse=True)
            for seq in best[:self.params.beam_width]:
                seq.text = tokenizer.decode(seq.tokens)
            results.append(BeamSearchOutput(prompt, best[:self.params.beam_width]))
        return results


def beam_search(engine: "LLMEngine", prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run a search to the end on an LLMEngine that nothing else is stepping."""
    search = BeamSearch(prompts, params, engine.input_processor.eos_token_ids)
    while not search.finished:
        for rid, prompt in search.requests():
            engine.add_request(rid, prompt, search.step_params, output_kind=OutputKind.FINAL_ONLY)
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out.outputs[0].logprobs[0]
        search.advance(results)
    return search.outputs(engine.get_tokenizer())


async def beam_search_async(llm: "AsyncLLM", prompts: list[list[int]], params: BeamSearchParams,
                            priority: int = 0) -> list[BeamSearchOutput]:
    """The same search through AsyncLLM, alongside whatever else the engine is serving."""
    search = BeamSearch(prompts, params, llm.engine.input_processor.eos_token_ids)
    while not search.finished:
        stream = await llm.add_requests(search.requests(), search.step_params, priority, OutputKind.FINAL_ONLY)
        results = {}
        try:
            async for out in stream:
                results[out.request_id] = out.outputs[0].logprobs[0]
        finally:
            stream.close()
        search.advance(results)
    return search.outputs(llm.engine.get_tokenizer())
