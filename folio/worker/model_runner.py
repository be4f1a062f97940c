"""ModelRunner: turns a SchedulerOutput into one forward pass over the flattened batch, then samples.

The batch carries no padding between requests: token ids, positions and cache slots of every scheduled
token are concatenated (gathered from the persistent per-request rows of worker/input_batch.py); each
request brings its query length and context length. Logits are computed only at the positions that
sample (and at prompt positions of requests that asked for prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.attention.backend import AttentionBackend
from folio.attention.selector import get_attention_backend
from folio.core.scheduler import ModelOutput, SampledToken, ScheduledRequest, SchedulerOutput
from folio.models import fused_ops
from folio.models.llama import StepContext
from folio.models.model_config import ModelConfig
from folio.sample import sampling_ops
from folio.sample.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from folio.worker.input_batch import BlockIdsFn, InputBatch


@dataclass
class _PromptLogprobsJob:
    request_id: str
    hidden_rows: slice  # rows of the step's hidden states whose logits predict prompt tokens
    targets: list[int]
    num_logprobs: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_model_len: int,
                 backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.inputs = InputBatch(max_num_seqs, max_model_len, block_size)
        self.backend = backend or get_attention_backend()
        if dtype == torch.bfloat16:
            fused_ops.prepare()  # the fused elementwise kernels serve bf16 only
        sampling_ops.prepare()
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # zeros, not empty: padded reads of never-written slots must be finite (masked, but NaN * 0 is NaN)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_hidden_layers)]
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: BlockIdsFn) -> ModelOutput:
        """One forward pass and sampling for the scheduled requests; block_ids(request_id, start) gives a
        request's block ids from index start on (only newly allocated blocks are asked for)."""
        self.inputs.remove(sched.finished_ids)
        self.inputs.remove(sched.preempted_ids)
        output = ModelOutput()
        if not sched.scheduled:
            return output
        step = self.inputs.prepare(sched.scheduled, block_ids)
        ctx = StepContext(self.backend, self.backend.build_metadata(step.layout), self.kv_caches)
        hidden = self.model(step.input_ids, step.positions, ctx)

        sample_rows, rows, jobs = [], [], []
        end = 0
        for item in sched.scheduled:
            req, start = item.request, end
            end += item.num_tokens
            if item.samples:
                sample_rows.append(end - 1)
                rows.append(SamplingRow(req.sampling_params, req.prompt_token_ids, req.output_token_ids,
                                        req.generator, req.stop_token_ids))
            job = self._prompt_logprobs_job(item, start)
            if job is not None:
                jobs.append(job)

        if rows:
            out = self.sampler(self.model.compute_logits(hidden[sample_rows]), rows)  # it makes its own fp32 copy
            samplers = [i for i in sched.scheduled if i.samples]
            for item, token, lp in zip(samplers, out.sampled_token_ids, out.logprobs):
                output.sampled[item.request.request_id] = SampledToken(token, lp)
        for job in jobs:
            logits = self.model.compute_logits(hidden[job.hidden_rows]).float()
            output.prompt_logprobs[job.request_id] = compute_prompt_logprobs(logits, job.targets, job.num_logprobs)
        return output

    @staticmethod
    def _prompt_logprobs_job(item: ScheduledRequest, first_row: int) -> _PromptLogprobsJob | None:
        """Prompt logprobs for the prompt positions this chunk computes."""
        req = item.request
        k = req.sampling_params.prompt_logprobs
        if k is None:
            return None
        # a recomputation after preemption skips the positions already handed out
        start = max(req.num_computed_tokens, req.num_prompt_logprobs)
        stop = min(req.num_computed_tokens + item.num_tokens, req.num_prompt_tokens - 1)  # p predicts token p + 1
        if stop <= start:
            return None
        first = first_row + start - req.num_computed_tokens
        return _PromptLogprobsJob(req.request_id, slice(first, first + stop - start),
                                  req.prompt_token_ids[start + 1:stop + 1], k)
