"""Scheduler: continuous batching under a token budget, with chunked prefill and recompute preemption.

One rule serves every case. Each step, with `max_num_batched_tokens` to give out:
  1. running requests first, in order: each gets the tokens it still lacks KV for (one when decoding,
     the next chunk of its prompt when prefilling), capped by what is left of the budget;
     when the cache has no block for one, the lowest-ranked running request is preempted (blocks freed,
     requeued at the front to be recomputed) until it fits, or until it is itself the victim;
  2. then, if nothing was preempted this step, waiting requests are admitted while budget, blocks and
     `max_num_seqs` allow, their prompts chunked to what is left of the budget (a request whose grammar is
     still compiling stays queued, and the ones behind it are admitted).
Prefill chunks and decode tokens of different requests then go through the same forward pass.

The step's result is a SchedulerOutput message (folio.core.step_contract) for the model runner: a request's
unchanging facts the first time it is scheduled, then per step only its counts and new block ids. The
runner's answer comes back through `update_from_output`, which appends the sampled tokens to the core's own
Requests and ends those that hit a stop condition. A pooling request (an embedding) is scheduled like any
prompt and ends as soon as the runner answers with its vector.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from folio.config import SchedulerOptions
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus
from folio.core.step_contract import (ModelRunnerOutput, NewRequestData, SampledLogprobs, ScheduledRequestData,
                                      SchedulerOutput)
from folio.spec_decode.stats import SpecDecodingStats


@dataclass
class CoreOutput:
    """One request's progress after a step, handed to the output processor."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledLogprobs]
    prompt_logprobs: Optional[list[SampledLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    first_scheduled_time: Optional[float] = None
    num_cached_tokens: int = 0
    pooled: Optional[list[float]] = None  # a pooling request's vector; it is finished


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int  # since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int  # of those, tokens found
    spec_decoding: SpecDecodingStats  # since start


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
    def __init__(self, config: SchedulerOptions, kv_cache_manager: KVCacheManager, max_model_len: int,
                 num_lookahead_tokens: int = 0) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        # slots reserved past each scheduled chunk, for a draft model's KV of the tokens it guesses
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        self.waiting = WaitingQueue(config.scheduling_policy)
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
        self.kv_cache_manager.reset_prefix_cache()

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage, self.num_preemptions,
                              prefix.queries, prefix.hits, self.spec_decoding_stats.snapshot())

    # ---- the step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # the known tokens and the drafts to verify after them, within the budget and the context length
            num_new = min(request.num_tokens + len(request.draft_token_ids) - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)) is None:
                victim = self._pick_victim()
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank, so i now points at the next one
            drafts = request.draft_token_ids[:max(0, request.num_computed_tokens + num_new - request.num_tokens)]
            request.draft_token_ids = []
            out.scheduled.append(ScheduledRequestData(request.request_id, request.num_computed_tokens, num_new,
                                                      new_blocks, drafts))
            budget -= num_new
            i += 1

        compiling: list[Request] = []  # waiting for their grammar: the requests behind them go first
        while (not out.preempted_ids and budget > 0 and len(self.waiting)
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()  # waiting requests have no computed tokens (new or preempted)
            if request.structured_output is not None and not request.structured_output.ready:
                compiling.append(self.waiting.pop())
                continue
            cached = self.kv_cache_manager.find_cached(request)
            num_cached = cached.num_blocks * self.kv_cache_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, cached, self.num_lookahead_tokens)
            if new_blocks is None:
                break
            self.waiting.pop()
            self.kv_cache_manager.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:  # new to the runner too (a resumed one it still knows)
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                out.new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                       request.sampling_params, request.stop_token_ids,
                                                       request.pooling_params))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequestData(request.request_id, num_cached, num_new, new_blocks))
            budget -= num_new
        for request in reversed(compiling):
            self.waiting.add_front(request)
        return out

    def _pick_victim(self) -> Request:
        if self.waiting.by_priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks and requeue it to recompute everything it knows."""
        self.running.remove(request)
        for scheduled in out.scheduled:
            if scheduled.request_id == request.request_id:  # already given tokens this step: take them back
                out.scheduled.remove(scheduled)
                break
        self.kv_cache_manager.unpublish_uncomputed(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)
        out.preempted_ids.append(request.request_id)

    def update_from_output(self, out: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[CoreOutput]:
        """Advance computed tokens, append sampled tokens, and finish requests that hit a stop condition."""
        outputs = []
        for scheduled in out.scheduled:
            request = self.requests[scheduled.request_id]
            request.num_computed_tokens += scheduled.num_tokens
            prompt_logprobs = self._new_prompt_logprobs(request, scheduled, runner_output)
            pooled = runner_output.pooled.get(request.request_id)
            if pooled is not None:
                outputs.append(self._finish_pooled(request, pooled))
                continue
            sampled = runner_output.sampled.get(request.request_id)
            if sampled is None:  # a prefill chunk that does not reach the end of the prompt yet
                if prompt_logprobs is not None:
                    outputs.append(CoreOutput(request.request_id, [], [], prompt_logprobs=prompt_logprobs))
                continue
            if scheduled.draft_token_ids:  # the KV of rejected drafts is not the request's: roll back past it
                num_accepted = len(sampled.token_ids) - 1
                request.num_computed_tokens -= len(scheduled.draft_token_ids) - num_accepted
                self.spec_decoding_stats.record(len(scheduled.draft_token_ids), num_accepted)
            status = None
            new_token_ids = []
            for token_id in sampled.token_ids:  # tokens after a stop are dropped
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            else:
                request.draft_token_ids = runner_output.draft_token_ids.get(request.request_id, [])
            outputs.append(CoreOutput(
                request.request_id, new_token_ids, sampled.logprobs[:len(new_token_ids)],
                prompt_logprobs=prompt_logprobs,
                finish_reason=status.finish_reason if status else None,
                stop_reason=request.stop_reason, first_scheduled_time=request.first_scheduled_time,
                num_cached_tokens=request.num_cached_tokens))
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float]) -> CoreOutput:
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return CoreOutput(request.request_id, [], [], finish_reason="stop",
                          first_scheduled_time=request.first_scheduled_time,
                          num_cached_tokens=request.num_cached_tokens, pooled=pooled)

    @staticmethod
    def _new_prompt_logprobs(request: Request, scheduled: ScheduledRequestData,
                             runner_output: ModelRunnerOutput) -> Optional[list[SampledLogprobs]]:
        """The prompt logprobs of this step's chunk that were not handed out before (a recomputation after a
        preemption computes them again); None when there are none."""
        entries = runner_output.prompt_logprobs.get(request.request_id)
        if entries is None:
            return None
        entries = entries[max(0, request.num_prompt_logprobs - scheduled.num_computed_tokens):]
        if not entries:
            return None
        request.num_prompt_logprobs += len(entries)
        return entries

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.structured_output is not None:  # its grammar follows the token: complete, or broken
            status = request.structured_output.advance(token_id)
            if status is not None:
                return status
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
