"""Output processing: core token streams -> text, stop strings, logprobs and RequestOutputs.

The engine core only deals in token ids; here each completion is detokenized incrementally, checked for
stop strings (a match ends the core request too), and its logprobs are turned into Logprob dicts.
The n samples of one request are gathered back into one RequestOutput. A pooling request has nothing to
detokenize: its one output, an EmbeddingRequestOutput, is made when the core hands over its vector.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from folio.core.scheduler import CoreOutput
from folio.detokenizer import IncrementalDetokenizer
from folio.engine.input_processor import Params, ProcessedPrompt, child_request_id
from folio.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, EngineOutput, Logprob,
                           RequestMetrics, RequestOutput)
from folio.core.step_contract import SampledLogprobs
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds everything so far
    DELTA = "delta"  # every output holds only what is new (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes (offline generate)


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    sent_tokens: int = 0  # for DELTA: how many tokens/logprobs were already handed out


@dataclass
class _RequestState:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    kind: OutputKind
    completions: dict[str, _Completion]  # child request id -> completion
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None
    sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}
        self.pooling: dict[str, ProcessedPrompt] = {}  # pooling requests in flight

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.pooling

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: Params, kind: OutputKind,
                    arrival_time: float) -> None:
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = prompt
            return
        completions = {}
        for i in range(params.n):
            child = child_request_id(request_id, i, params.n)
            completions[child] = _Completion(
                i, IncrementalDetokenizer(self.tokenizer, prompt.prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[child] = request_id
        self.states[request_id] = _RequestState(
            request_id, prompt, params, kind, completions, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        state = self.states.get(request_id)
        return list(state.completions) if state else []

    def remove(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        for child in (state.completions if state else ()):
            self.child_to_parent.pop(child, None)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[EngineOutput], list[str]]:
        """Returns the outputs to hand out and the core requests that a stop string ended."""
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        outputs: list[EngineOutput] = []
        now = time.monotonic()
        for out in core_outputs:
            if out.pooled is not None:
                prompt = self.pooling.pop(out.request_id)
                outputs.append(EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled),
                                                      prompt.prompt_token_ids))
                continue
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:
                continue
            state = self.states[parent]
            touched[parent] = state
            metrics = state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_token_ids:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            if out.prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._to_logprob_dict(e) for e in out.prompt_logprobs)
            comp = state.completions[out.request_id]
            if comp.finish_reason is not None:
                continue
            comp.token_ids.extend(out.new_token_ids)
            for token, lp in zip(out.new_token_ids, out.new_logprobs):
                entry = self._to_logprob_dict(lp)
                comp.logprobs.append(entry)
                comp.cumulative_logprob += entry[token].logprob
            # the EOS or stop token that ended the sequence is left out of the text (as vLLM does)
            stop_str = comp.detokenizer.update(out.new_token_ids, stop_terminated=out.finish_reason == "stop") \
                if out.new_token_ids else None
            if stop_str is not None:
                comp.finish_reason, comp.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    stopped.append(out.request_id)
            elif out.finish_reason is not None:
                comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason

        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
            result = self._make_output(state)
            if result is not None:
                outputs.append(result)
            if state.finished:
                self.remove(state.request_id)
        return outputs, stopped

    def abort(self, request_id: str) -> Optional[EngineOutput]:
        """Mark a request aborted; returns its final output for streams still listening."""
        if request_id in self.pooling:
            return EmbeddingRequestOutput(request_id, None, self.pooling.pop(request_id).prompt_token_ids)
        state = self.states.get(request_id)
        if state is None:
            return None
        for comp in state.completions.values():
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        output = self._make_output(state)
        self.remove(request_id)
        return output

    def _to_logprob_dict(self, lp: SampledLogprobs) -> dict[int, Logprob]:
        return {t: Logprob(v, r, self.tokenizer.decode_token(t)) for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks)}

    def _make_output(self, state: _RequestState) -> Optional[RequestOutput]:
        finished = state.finished
        if state.kind == OutputKind.FINAL_ONLY and not finished:
            return None
        delta = state.kind == OutputKind.DELTA
        completions = []
        for comp in state.completions.values():
            done = comp.finish_reason is not None
            start = comp.sent_tokens if delta else 0
            if delta and start == len(comp.token_ids) and not done:
                continue
            text = comp.detokenizer.get_delta(done) if delta else comp.detokenizer.output_text
            completions.append(CompletionOutput(
                comp.index, text, comp.token_ids[start:], comp.cumulative_logprob,
                comp.logprobs[start:] if comp.logprobs is not None else None, comp.finish_reason, comp.stop_reason))
            comp.sent_tokens = len(comp.token_ids)
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs, state.sent_prompt_logprobs = prompt_logprobs[state.sent_prompt_logprobs:], len(prompt_logprobs)
        return RequestOutput(state.request_id, state.prompt.prompt, state.prompt.prompt_token_ids, completions,
                             finished, prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics)
