"""CounterTotals: Prometheus counters that follow totals counted elsewhere since start.

The engine keeps running totals (preemptions, prefix cache hits, drafts accepted, grammars compiled, ...); a
Prometheus counter can only be advanced. After each step a StatLogger hands the latest totals here, and each
counter advances by what its total grew since it was last seen. A counter is fetched (and so, for a labelled
one, created) only once its total first grows, so a series appears with its first count.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Iterable, TypeVar

from prometheus_client import Counter

K = TypeVar("K", bound=Hashable)


class CounterTotals(Generic[K]):
    def __init__(self, counter: Callable[[K], Counter]) -> None:
        self._counter = counter  # the counter that follows a key's total
        self._seen: dict[K, float] = {}

    def advance(self, totals: Iterable[tuple[K, float]]) -> None:
        """Advance each key's counter by what its total grew; a total that shrank advances nothing."""
        for key, total in totals:
            grown = total - self._seen.get(key, 0)
            if grown > 0:
                self._counter(key).inc(grown)
                self._seen[key] = total
