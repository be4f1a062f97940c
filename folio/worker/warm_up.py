"""Warm start: a throwaway request through the model runner before the first real one.

The first step of a process pays for set-up that later steps do not: MKL's and oneDNN's first calls (thread
pools, JIT-generated kernels, primitives), OpenMP's threads, the first calls into folio's C++ kernels. The
engine runs one short prefill chunk and one decode step of a request of its own at start, through the step
contract like any scheduler would, so that the first real request runs as fast as the next ones.

The request's KV goes into the first blocks of the cache behind the block pool's back, like the leftovers of a
finished request: the pool never hashes or publishes those blocks (only blocks it hands out can become cached
prefixes), and whichever request gets them next writes every slot it reads. Its drafts, if a speculator
proposes any, are dropped with it.
"""

from __future__ import annotations

from folio.core.step_contract import NewRequestData, ScheduledRequestData, SchedulerOutput
from folio.sampling_params import SamplingParams
from folio.utils.math_utils import cdiv
from folio.worker.model_runner import ModelRunner

WARM_UP_REQUEST_ID = "folio-warm-up"
WARM_UP_PROMPT_LEN = 16  # tokens of the prefill chunk (one block by default): short, so start-up stays quick


def warm_up(runner: ModelRunner, block_size: int, max_model_len: int, prompt_len: int = WARM_UP_PROMPT_LEN) -> None:
    """Prefill prompt_len tokens, decode one, forget it; a shorter prompt where the cache holds fewer than its
    prompt_len + 1 positions or max_model_len fewer than its prompt_len + 2 tokens (two of them sampled)."""
    prompt_len = min(prompt_len, max_model_len - 2, runner.num_blocks * block_size - 1)
    if prompt_len < 1:
        return
    prompt = [token % 100 + 1 for token in range(prompt_len)]  # any ids the vocabulary has
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    blocks = list(range(cdiv(prompt_len + 1, block_size)))
    new = NewRequestData(WARM_UP_REQUEST_ID, prompt, params, frozenset())
    # the same blocks in every KV cache group: the throwaway request's KV is never read back by another
    groups = tuple(blocks for _ in runner.inputs.block_tables)
    runner.execute(SchedulerOutput([new], [ScheduledRequestData(WARM_UP_REQUEST_ID, 0, prompt_len, groups)]))
    no_new_blocks = tuple([] for _ in runner.inputs.block_tables)
    runner.execute(SchedulerOutput(scheduled=[ScheduledRequestData(WARM_UP_REQUEST_ID, prompt_len, 1,
                                                                   no_new_blocks)]))
    runner.execute(SchedulerOutput(finished_ids=[WARM_UP_REQUEST_ID]))
