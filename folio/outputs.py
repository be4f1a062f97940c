"""What users get back: RequestOutput and CompletionOutput (generation), EmbeddingRequestOutput (pooling), in the
shapes vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """Log-probability of one token, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the top-k plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", or None while running
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """The state of a request after a step: its prompt and each of its completions so far."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The vector of a pooling request (`LLM.embed`); `outputs` is None when it was aborted before its prompt ran."""

    request_id: str
    outputs: Optional[EmbeddingOutput]
    prompt_token_ids: list[int]
    finished: bool = True


EngineOutput = Union[RequestOutput, EmbeddingRequestOutput]  # what an engine step hands out
