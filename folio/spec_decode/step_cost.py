"""StepCostModel: how long a decode step takes for the number of tokens it computes, measured on this machine.

Speculation trades longer steps for fewer of them; whether that pays depends on how a step's time grows
with its tokens, which differs by CPU, dtype, model, batch and the load of the moment: verifying a few guesses
is nearly free where a step is bound by reading the weights, and costs as much as it saves where the matmuls
are compute-bound. So the model runner reports every decode step's time here, and the speculator asks what a
step of n tokens would cost before it decides how many guesses to make.

Times are kept per token count, averaged with exponential decay (recent steps weigh most); an unmeasured
count is interpolated between measured ones, or, outside them, extrapolated from the nearest measured count
at PRIOR_TOKEN_COST of its time per token more (or less) — an optimistic guess, so that longer steps get tried
and measured rather than ruled out unseen.
"""

from __future__ import annotations

import bisect

PRIOR_TOKEN_COST = 0.05  # an extra token's share of a one-token step, until measured
DECAY = 0.9  # weight of the past in each count's average


class StepCostModel:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # tokens in the step -> decayed average time
        self._counts: list[int] = []  # the measured token counts, ascending

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self._seconds.get(num_tokens)
        if old is None:
            bisect.insort(self._counts, num_tokens)
            self._seconds[num_tokens] = seconds
        else:
            self._seconds[num_tokens] = DECAY * old + (1.0 - DECAY) * seconds

    def cost(self, num_tokens: int) -> float:
        """Estimated seconds of a decode step computing num_tokens tokens (in units of a one-token step before
        any measurement: only ratios matter to the speculator)."""
        if not self._counts:
            return 1.0 + PRIOR_TOKEN_COST * (num_tokens - 1)
        if num_tokens in self._seconds:
            return self._seconds[num_tokens]
        i = bisect.bisect(self._counts, num_tokens)
        if 0 < i < len(self._counts):  # between two measured counts
            low, high = self._counts[i - 1], self._counts[i]
            share = (num_tokens - low) / (high - low)
            return self._seconds[low] + share * (self._seconds[high] - self._seconds[low])
        nearest = self._counts[min(i, len(self._counts) - 1)]
        return self._seconds[nearest] * max(0.5, 1.0 + PRIOR_TOKEN_COST * (num_tokens - nearest))
