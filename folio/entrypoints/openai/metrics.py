"""Prometheus metrics, one for one with vLLM's `vllm:*` names under the `folio:` prefix, labelled model_name.

Each app gets its own CollectorRegistry (several servers in one process, as in tests, must not share
counters). The AsyncLLM calls `record` on its engine thread after every step; prometheus_client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from folio.core.scheduler import SchedulerStats
from folio.engine.stats import IterationStats
from folio.entrypoints.openai.counter_totals import CounterTotals
from folio.spec_decode.stats import SpecDecodingStats

FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"folio:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"folio:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"folio:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage (fraction of blocks in use, 0 to 1).")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        # the scheduler counts these since start; the counters advance by the difference
        self.since_start = {
            "num_preemptions": counter("num_preemptions", "Cumulative number of preemptions."),
            "prefix_cache_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        }
        self._since_start_totals = CounterTotals(self.since_start.__getitem__)
        self.spec_decode = {
            "num_drafts": counter("spec_decode_num_drafts", "Verification steps that checked draft tokens."),
            "num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
            "num_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        }
        self._spec_decode_totals = CounterTotals(self.spec_decode.__getitem__)
        self.accepted_per_pos = Counter("folio:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by their position among a step's drafts.",
                                        labels + ["position"], registry=registry)
        self._per_pos_totals = CounterTotals(lambda pos: self.accepted_per_pos.labels(model_name, str(pos)))
        self.success = Counter("folio:request_success", "Count of finished requests by finish reason.",
                               labels + ["finished_reason"], registry=registry)
        for reason in FINISH_REASONS:  # each series exists (at 0) before the first request, so rate() works at once
            self.success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from arrival.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    _REQUEST_BUCKETS)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.running.set(scheduler_stats.num_running)
        self.waiting.set(scheduler_stats.num_waiting)
        self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
        self._since_start_totals.advance((name, getattr(scheduler_stats, name)) for name in self.since_start)
        self._record_spec_decoding(scheduler_stats.spec_decoding)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for value in iteration_stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration_stats.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration_stats.finished:
            for reason in finished.finish_reasons:
                self.success.labels(self.model_name, reason).inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)

    def _record_spec_decoding(self, stats: SpecDecodingStats) -> None:
        self._spec_decode_totals.advance((name, getattr(stats, name)) for name in self.spec_decode)
        self._per_pos_totals.advance(enumerate(stats.num_accepted_tokens_per_pos))
