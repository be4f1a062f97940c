"""Request statistics for metrics, computed from the RequestOutputs a step hands out.

As in vLLM, the engine core only stamps monotonic times on requests (RequestMetrics); intervals and token
counts are worked out here, on the frontend side, so the step loop stays cheap and knows nothing of Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from folio.outputs import EngineOutput, RequestOutput


@dataclass
class FinishedRequestStats:
    finish_reasons: list[str]  # one per completion ("stop", "length", "abort")
    e2e_latency: float  # arrival -> finished, seconds
    queue_time: Optional[float]  # arrival -> first scheduled; None when it never ran (aborted while waiting)
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What changed in one step (or one batch of aborts)."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _Progress:
    num_generation_tokens: int = 0
    last_token_time: Optional[float] = None


class StatsCollector:
    """Turns each batch of DELTA or FINAL_ONLY outputs into IterationStats.

    Per unfinished request it keeps only a token count and the time of its previous token, which the
    inter-token latency needs (RequestMetrics.last_token_time is overwritten every step).
    """

    def __init__(self) -> None:
        self._progress: dict[str, _Progress] = {}

    def record(self, outputs: list[EngineOutput]) -> IterationStats:
        """Pooling requests (embeddings) generate no tokens and are left out."""
        stats = IterationStats()
        for out in outputs:
            if not isinstance(out, RequestOutput):
                continue
            metrics = out.metrics
            progress = self._progress.setdefault(out.request_id, _Progress())
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            if new_tokens and metrics is not None and metrics.last_token_time is not None:
                if progress.last_token_time is None:
                    stats.time_to_first_tokens.append(metrics.first_token_time - metrics.arrival_time)
                    stats.num_prompt_tokens += len(out.prompt_token_ids)
                else:
                    stats.inter_token_latencies.append(metrics.last_token_time - progress.last_token_time)
                progress.last_token_time = metrics.last_token_time
            progress.num_generation_tokens += new_tokens
            stats.num_generation_tokens += new_tokens
            if out.finished:
                del self._progress[out.request_id]
                if metrics is not None:
                    stats.finished.append(self._finished(out, progress))
        return stats

    @staticmethod
    def _finished(out: RequestOutput, progress: _Progress) -> FinishedRequestStats:
        metrics = out.metrics
        end = metrics.finished_time if metrics.finished_time is not None else metrics.arrival_time
        queued = None if metrics.first_scheduled_time is None else metrics.first_scheduled_time - metrics.arrival_time
        return FinishedRequestStats([c.finish_reason or "abort" for c in out.outputs], end - metrics.arrival_time,
                                    queued, len(out.prompt_token_ids), progress.num_generation_tokens)
