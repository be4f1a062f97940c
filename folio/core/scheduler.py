"""Scheduler: continuous batching under a token budget, with chunked prefill and recompute preemption.

One rule serves every case. Each step, with `max_num_batched_tokens` to give out:
  1. running requests first, in order: each gets the tokens it still lacks KV for (one when decoding,
     the next chunk of its prompt when prefilling), capped by what is left of the budget;
     when the cache has no block for one, the lowest-ranked running request is preempted (blocks freed,
     requeued at the front to be recomputed) until it fits, or until it is itself the victim;
  2. then, if nothing was preempted this step, waiting requests are admitted while budget, blocks and
     `max_num_seqs` allow, their prompts chunked to what is left of the budget.
Prefill chunks and decode tokens of different requests then go through the same forward pass.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens whose KV this step computes, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so the step yields a new token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step: the model runner drops whatever it kept for them.
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SampledToken:
    """What the model runner produced for one request that sampled this step."""

    token_id: int
    logprobs: Optional[object] = None  # folio.sample.sampler.SampledLogprobs


@dataclass
class ModelOutput:
    """The model runner's result for a step, keyed by request id."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # prompt logprobs of the prompt positions each request's chunk computed this step
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


@dataclass
class CoreOutput:
    """One request's progress after a step, handed to the output processor."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[object]
    prompt_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    first_scheduled_time: Optional[float] = None
    num_cached_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int  # since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int  # of those, tokens found


class WaitingQueue:
    """FCFS: arrival order, preempted requests in front. Priority: (priority, arrival time) order."""

    def __init__(self, policy: str) -> None:
        self.by_priority = policy == "priority"
        self._items: deque[Request] | list[Request] = [] if self.by_priority else deque()

    @staticmethod
    def _key(r: Request) -> tuple[int, float]:
        return (r.priority, r.arrival_time)

    def add(self, request: Request) -> None:
        if self.by_priority:
            bisect.insort(self._items, request, key=self._key)
        else:
            self._items.append(request)

    def add_front(self, request: Request) -> None:
        if self.by_priority:
            self.add(request)
        else:
            self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0) if self.by_priority else self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.scheduler.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, or a stop string found by the detokenizer)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache.prefix_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache.usage, self.num_preemptions,
                              prefix.queries, prefix.hits)

    # ---- the step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.scheduler.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self._pick_victim()
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank, so i now points at the next one
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1

        while (not out.preempted_ids and budget > 0 and len(self.waiting)
               and len(self.running) < self.config.scheduler.max_num_seqs):
            request = self.waiting.peek()  # waiting requests have no computed tokens (new or preempted)
            cached = self.kv_cache.find_cached(request)
            num_cached = len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            self.waiting.pop()
            self.kv_cache.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _pick_victim(self) -> Request:
        if self.waiting.by_priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks and requeue it to recompute everything it knows."""
        self.running.remove(request)
        for scheduled in out.scheduled:
            if scheduled.request is request:  # already given tokens this step: take them back
                out.scheduled.remove(scheduled)
                break
        self.kv_cache.unpublish_uncomputed(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)
        out.preempted_ids.append(request.request_id)

    def update_from_output(self, out: SchedulerOutput, model_output: ModelOutput) -> list[CoreOutput]:
        """Advance computed tokens, append sampled tokens, and finish requests that hit a stop condition."""
        outputs = []
        for scheduled in out.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_tokens
            prompt_logprobs = model_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs:
                request.num_prompt_logprobs += len(prompt_logprobs)
            result = model_output.sampled.get(request.request_id)
            if result is None:  # a prefill chunk that does not reach the end of the prompt yet
                if prompt_logprobs is not None:
                    outputs.append(CoreOutput(request.request_id, [], [], prompt_logprobs=prompt_logprobs))
                continue
            request.append_output_token(result.token_id)
            status = self._check_stop(request, result.token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(CoreOutput(
                request.request_id, [result.token_id],
                [result.logprobs] if result.logprobs is not None else [],
                prompt_logprobs=prompt_logprobs,
                finish_reason=status.finish_reason if status else None,
                stop_reason=request.stop_reason, first_scheduled_time=request.first_scheduled_time,
                num_cached_tokens=request.num_cached_tokens))
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens and token_id in request.stop_token_ids:
            # EOS ends a request without a stop_reason (as in vLLM); explicit stop ids are reported
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
