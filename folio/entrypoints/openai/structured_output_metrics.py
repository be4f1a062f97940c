"""Prometheus counters of structured outputs, from the engine core's StructuredOutputManager.stats: how many
grammars were compiled (and the seconds that took on the compile thread), how many requests found theirs in the
cache, and the seconds the step loop spent filling token bitmasks. A StatLogger, recorded after every step on the
engine thread, next to folio.entrypoints.openai.metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from folio.core.scheduler import SchedulerStats
from folio.engine.stats import IterationStats
from folio.entrypoints.openai.counter_totals import CounterTotals
from folio.structured_output.manager import StructuredOutputStats

_COUNTERS = {  # field of StructuredOutputStats -> (metric name, help)
    "num_compiles": ("structured_output_compiles", "Grammars compiled (JSON schemas, regexes, grammars, tools)."),
    "compile_s": ("structured_output_compile_seconds", "Seconds spent compiling grammars, off the step loop."),
    "num_cache_hits": ("structured_output_cache_hits", "Constrained requests whose grammar was already compiled."),
    "bitmask_s": ("structured_output_bitmask_seconds", "Seconds the step loop spent filling token bitmasks."),
    "num_bitmask_rows": ("structured_output_bitmask_rows", "Token bitmask rows filled (constrained samples)."),
}


class StructuredOutputStatLogger:
    def __init__(self, stats: StructuredOutputStats, model_name: str, registry: CollectorRegistry) -> None:
        self.stats = stats
        self.counters = {field: Counter(f"folio:{name}", doc, ["model_name"], registry=registry).labels(model_name)
                         for field, (name, doc) in _COUNTERS.items()}
        self._totals = CounterTotals(self.counters.__getitem__)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._totals.advance((field, getattr(self.stats, field)) for field in self.counters)
