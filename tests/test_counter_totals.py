"""CounterTotals: Prometheus counters advanced from totals counted since start (the server's StatLoggers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from folio.entrypoints.openai.counter_totals import CounterTotals


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["position"]: s.value for m in registry.collect() for s in m.samples if s.name.endswith("_total")}


def test_counters_advance_by_what_each_total_grew():
    registry = CollectorRegistry()
    counter = Counter("accepted", "", ["position"], registry=registry)
    totals = CounterTotals(lambda pos: counter.labels(str(pos)))
    totals.advance(enumerate([3, 0]))
    assert _samples(registry) == {"0": 3}  # a series appears with its first count
    totals.advance(enumerate([5, 2, 1]))
    assert _samples(registry) == {"0": 5, "1": 2, "2": 1}
    totals.advance(enumerate([4, 2, 1]))  # a total that shrank advances nothing, and is not counted again
    totals.advance(enumerate([5, 2, 1]))
    assert _samples(registry) == {"0": 5, "1": 2, "2": 1}
