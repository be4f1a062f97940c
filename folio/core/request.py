"""Request: the engine core's view of one sequence being generated.

The scheduler's single rule works on two numbers per request: how many tokens it knows (prompt + output)
and how many of those have KV in the cache (`num_computed_tokens`). Each step gives a request tokens until
the second catches up with the first; prefill, chunked prefill, decode and resumption after preemption
are all that one rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams]  # None for a pooling request, which samples nothing
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: Optional[object] = None
    first_scheduled_time: Optional[float] = None  # monotonic; queue time = this - arrival_time
    cache_salt: Optional[str] = None  # requests with different salts never share prefix-cache blocks
    pooling_params: Optional[PoolingParams] = None  # an embedding request: ends with its prompt, pooled
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were already handed out (never twice)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far (prefix caching)
    output_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (speculative decoding)
    all_token_ids: list[int] = field(init=False)  # prompt + output in one list (block hashes read it)
    # Tokens that end the request (and that min_tokens must hold back): stop_token_ids, plus EOS unless ignore_eos.
    stop_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        eos = frozenset() if params is None or params.ignore_eos else self.eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids if params else ()) | eos

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and mean pooling read every prompt position, so none may come from the prefix cache."""
        if self.pooling_params is not None:
            return self.pooling_params.needs_every_position
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
