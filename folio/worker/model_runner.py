"""ModelRunner: turns a SchedulerOutput into one forward pass over the flattened batch, then samples.

It works from the step messages alone (folio.core.step_contract): the per-request state it needs (tokens,
block tables, generators, sampling history) is its own, built from those messages and its own samples.

The batch carries no padding between requests: token ids, positions and cache slots of every scheduled
token are concatenated (gathered from the persistent per-request rows of worker/input_batch.py); each
request brings its query length and context length. Logits are computed only at the positions that
sample (and at prompt positions of requests that asked for prompt logprobs); a pooling request's hidden
states go to the pooler instead (worker/pooler.py), which answers with its vector when its prompt ends. With
speculative decoding, a request's draft tokens follow its known ones in the batch, the rejection sampler
verifies them, and the speculator proposes the next ones (folio.spec_decode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from folio.attention.backend import AttentionBackend
from folio.core.step_contract import ModelRunnerOutput, SampledTokens, ScheduledRequestData, SchedulerOutput
from folio.models import fused_ops
from folio.models.llama import StepContext
from folio.models.recurrent_state import RecurrentStates
from folio.sample import sampling_ops
from folio.sample.logits_processors import default_logits_processors
from folio.sample.rejection_sampler import RejectionSampler
from folio.sample.sampler import Sampler, compute_prompt_logprobs
from folio.sample.sampling_metadata import SamplingMetadata
from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.draft_model import DraftModel
from folio.spec_decode.factory import make_speculator
from folio.structured_output.token_mask import GrammarTokenMask
from folio.worker.input_batch import InputBatch
from folio.worker.kv_cache import KVCacheSpec
from folio.worker.pooler import Pooler
from folio.worker.request_state import RequestState


@dataclass
class _PromptLogprobsJob:
    request_id: str
    hidden_rows: slice  # rows of the step's hidden states whose logits predict prompt tokens
    targets: list[int]
    num_logprobs: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache_spec: KVCacheSpec, num_blocks: int, max_num_seqs: int,
                 max_model_len: int, backend: AttentionBackend, device: torch.device,
                 speculative_config: Optional[SpeculativeConfig] = None, draft: Optional[DraftModel] = None, *,
                 step_threads: Callable[[int], ContextManager[None]]) -> None:
        """step_threads: the platform's threads for a step of so many tokens (Platform.step_threads)."""
        self.model = model
        self.step_threads = step_threads
        self.backend = backend
        self.device = device
        self.num_blocks = num_blocks
        self.kv_cache_spec = kv_cache_spec
        self.inputs = InputBatch(max_num_seqs, max_model_len, kv_cache_spec.block_size, device,
                                 num_groups=len(kv_cache_spec.groups))
        self.requests: dict[str, RequestState] = {}
        if kv_cache_spec.dtype == torch.bfloat16:
            fused_ops.prepare()  # the fused elementwise kernels serve bf16 only
        sampling_ops.prepare()
        self.kv_caches = kv_cache_spec.allocate(backend, num_blocks, device)
        # a hybrid model's (LFM2's convolutions, Granite 4.0-H's Mamba2 layers): max_num_seqs rows, resident as written
        state_shapes = getattr(model, "recurrent_state_shapes", None)
        self.recurrent = (None if state_shapes is None
                          else RecurrentStates(state_shapes(), max_num_seqs, kv_cache_spec.dtype, device))
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.logits_processors = [GrammarTokenMask(), *default_logits_processors()]
        self.pooler = Pooler()
        self.speculator = None if speculative_config is None else make_speculator(speculative_config, self, draft)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over the scheduled requests and sampling for those that reach their last token."""
        self._update_states(sched)
        output = ModelRunnerOutput()
        if sched.scheduled:
            with self.step_threads(sched.num_tokens):
                self._forward_and_sample(sched, output)
        return output

    def _forward_and_sample(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> None:
        start_time = time.perf_counter()
        step = self.inputs.prepare(sched.scheduled, self.requests)
        # one per KV cache group (sliding-window layers have groups of their own), each from the group's tables
        metadata = [self.backend.build_metadata(layout) for layout in step.layouts]
        recurrent = None if self.recurrent is None else self.recurrent.step(
            step.rows, [item.num_computed_tokens == 0 for item in sched.scheduled],
            [item.num_tokens for item in sched.scheduled])
        ctx = StepContext(self.backend, metadata, self.kv_caches, recurrent)
        hidden = self.model(step.input_ids, step.positions, ctx)

        sample_rows, samplers, drafts, jobs = [], [], [], []
        end = 0
        for item in sched.scheduled:
            request, start = self.requests[item.request_id], end
            end += item.num_tokens
            if request.pooling_params is not None:
                vector = self.pooler.add_chunk(item.request_id, request.pooling_params, hidden[start:end],
                                               item.num_computed_tokens, len(request.prompt_token_ids))
                if vector is not None:
                    output.pooled[item.request_id] = vector
                continue
            num_drafts = len(item.draft_token_ids)
            if item.num_computed_tokens + item.num_tokens == request.num_tokens + num_drafts:  # reaches the end
                sample_rows.extend(range(end - 1 - num_drafts, end))  # the last known token's row, the drafts'
                samplers.append(request)
                drafts.append(item.draft_token_ids)
            if request.params.prompt_logprobs is not None:
                job = self._prompt_logprobs_job(item, request, start)
                if job is not None:
                    jobs.append(job)

        if samplers:
            bitmask = sched.grammar_bitmask  # structured outputs: what each constrained request may sample
            for request, draft in zip(samplers, drafts):
                request.token_bitmasks = bitmask.rows_of(request.request_id, 1 + len(draft)) if bitmask else None
            for request, draft, sampled in zip(samplers, drafts, self._sample(hidden[sample_rows], samplers, drafts)):
                request.output_token_ids.extend(sampled.token_ids)
                self.inputs.append_tokens(request.request_id, sampled.token_ids)
                if draft:
                    self.speculator.verified(request, len(draft), len(sampled.token_ids) - 1)
                output.sampled[request.request_id] = sampled
            if self.speculator is not None:
                if len(samplers) == len(sched.scheduled) and sched.num_tokens == len(sample_rows):  # decodes only
                    self.speculator.observe_step(sched.num_tokens, time.perf_counter() - start_time)
                output.draft_token_ids = self.speculator.propose(
                    samplers, [self.inputs.tokens(r.request_id) for r in samplers])
        for job in jobs:
            logits = self.model.compute_logits(hidden[job.hidden_rows]).float()
            output.prompt_logprobs[job.request_id] = compute_prompt_logprobs(logits, job.targets, job.num_logprobs)

    def _sample(self, hidden: torch.Tensor, requests: list[RequestState],
                drafts: list[list[int]]) -> list[SampledTokens]:
        """One token per request from its rows of hidden states, or with drafts to verify, the accepted ones and
        one more. A step whose every row is plain greedy takes the head's argmax (its method may never write the
        logits); the samplers make their own float32 copies of the logits."""
        if any(drafts):
            return self.rejection_sampler(self.model.compute_logits(hidden), requests, drafts, self.logits_processors)
        metadata = SamplingMetadata.build(requests, self.logits_processors)
        if not metadata.full_rows:
            return [SampledTokens([token], []) for token in self.model.compute_greedy_tokens(hidden).tolist()]
        out = self.sampler(self.model.compute_logits(hidden), metadata)
        return [SampledTokens([token], [lp] if lp is not None else [])
                for token, lp in zip(out.sampled_token_ids, out.logprobs)]

    def _update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished requests, drop the block tables of preempted ones, take in new ones."""
        for request_id in sched.finished_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and self.speculator is not None:
                self.speculator.finished(request)
        self.pooler.forget(sched.finished_ids)
        self.inputs.remove(sched.finished_ids)
        self.inputs.remove(sched.preempted_ids)
        if self.speculator is not None:
            for request_id in sched.preempted_ids:
                self.speculator.preempted(request_id)
        for new in sched.new_requests:
            self.requests[new.request_id] = RequestState.from_new_request(new)

    @staticmethod
    def _prompt_logprobs_job(item: ScheduledRequestData, request: RequestState,
                             first_row: int) -> _PromptLogprobsJob | None:
        """Prompt logprobs for the prompt positions this chunk computes (p predicts token p + 1). After a
        preemption they are computed again; the core drops those it has already handed out."""
        start = item.num_computed_tokens
        stop = min(start + item.num_tokens, len(request.prompt_token_ids) - 1)
        if stop <= start:
            return None
        return _PromptLogprobsJob(request.request_id, slice(first_row, first_row + stop - start),
                                  request.prompt_token_ids[start + 1:stop + 1], request.params.prompt_logprobs)
