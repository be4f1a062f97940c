"""SamplingMetadata: what the sampler needs to know about one step's rows, worked out once per step.

Which rows are plain greedy (argmax of the model's own logits, nothing else: the fast path), and for the
others which logits processors apply to which of them, which want logprobs and which draw at random. The
model runner builds it from its RequestStates; the sampler's passes then only index, never re-decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.sample.logits_processors import LogitsProcessor
from folio.worker.request_state import RequestState


@dataclass
class SamplingMetadata:
    requests: list[RequestState]  # one per row of the step's logits
    fast_rows: list[int] = field(default_factory=list)  # plain greedy rows: argmax of the model's logits
    full_rows: list[int] = field(default_factory=list)  # the rest, ascending: the sampler's float32 path
    # Below, rows are positions within full_rows.
    processors: list[tuple[LogitsProcessor, list[int]]] = field(default_factory=list)  # in application order
    logprob_rows: list[int] = field(default_factory=list)
    random_rows: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, requests: list[RequestState], processors: list[LogitsProcessor]) -> "SamplingMetadata":
        meta = cls(requests)
        applied: list[list[int]] = [[] for _ in processors]
        for i, request in enumerate(requests):
            params = request.params
            uses = [j for j, p in enumerate(processors) if p.applies(request)]
            if params.is_greedy and params.logprobs is None and not uses:
                meta.fast_rows.append(i)
                continue
            position = len(meta.full_rows)
            meta.full_rows.append(i)
            for j in uses:
                applied[j].append(position)
            if params.logprobs is not None:
                meta.logprob_rows.append(position)
            if not params.is_greedy:
                meta.random_rows.append(position)
        meta.processors = [(p, rows) for p, rows in zip(processors, applied) if rows]
        return meta

    def subset(self, rows: list[int]) -> list[RequestState]:
        return [self.requests[i] for i in rows]
