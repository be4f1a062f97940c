"""Beam search, run above the engine as vLLM does since V1: each step, every live beam is one single-token
request asking for its top 2 * beam_width logprobs; the best beam_width extensions survive.

Beams of one prompt share their common prefix through the prefix cache, so a step computes only what is
new in each beam (its last partial block and token), never the whole prompt again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from folio.engine.input_processor import MAX_LOGPROBS
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.sampling_params import SamplingParams


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


def beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    eos = engine.input_processor.eos_token_ids
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    live = [[BeamSearchSequence([])] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    ids = itertools.count()

    for step in range(params.max_tokens):
        pending = {}
        for p, beams in enumerate(live):
            for beam in beams:
                rid = f"beam-{next(ids)}"
                engine.add_request(rid, {"prompt_token_ids": prompts[p] + beam.tokens}, step_params,
                                   output_kind=OutputKind.FINAL_ONLY)
                pending[rid] = (p, beam)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        while engine.has_unfinished_requests():
            for out in engine.step():
                p, beam = pending[out.request_id]
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates[p].append(BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp.logprob))
        last = step == params.max_tokens - 1
        for p, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            survivors = []
            for cand in cands[:2 * params.beam_width]:
                if not params.ignore_eos and cand.tokens[-1] in eos:
                    cand.finish_reason = "stop"
                    done[p].append(cand)
                elif len(survivors) < params.beam_width:
                    survivors.append(cand)
            if last:
                for beam in survivors:
                    beam.finish_reason = "length"
                done[p].extend(survivors)
                survivors = []
            live[p] = survivors
        if not any(live):
            break

    tokenizer = engine.get_tokenizer()
    results = []
    for prompt, finished in zip(prompts, done):
        best = sorted(finished, key=lambda s: s.score(params.length_penalty), reverse=True)[:params.beam_width]
        for seq in best:
            seq.text = tokenizer.decode(seq.tokens)
        results.append(BeamSearchOutput(prompt, best))
    return results
