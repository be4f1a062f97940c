"""What `folio bench serve` measured: one record per request and the run's summary. Its own module so that
the benchmark (which fills it) and the charts (which draw it) both depend on it, not on each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from folio.bench.report import Summary


@dataclass
class RequestRecord:
    start_s: float  # when it was sent, seconds after the benchmark started
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.latency_s is not None


@dataclass
class ServeResult:
    base_url: str
    endpoint: str
    model: str
    workload: str
    request_rate: Optional[float]  # requests/s; None = all at once
    max_concurrency: Optional[int]
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s of completed requests
    total_token_throughput: float  # prompt + output tokens/s of completed requests
    prompt_tokens: int
    output_tokens: int
    ttft: Optional[Summary]
    tpot: Optional[Summary]
    itl: Optional[Summary]
    e2e_latency: Optional[Summary]
    requests: list[RequestRecord]
