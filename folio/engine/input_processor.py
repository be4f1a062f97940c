"""Input processing: validate a prompt and its SamplingParams, tokenize, and build the core Requests.

Everything a request could be rejected for is checked here, before it reaches the scheduler, so that a
bad request raises a ValueError naming its field and never disturbs the requests already running.
A request with n > 1 becomes n independent core requests ("{i}_{request_id}") that the output
processor gathers back into one RequestOutput. A request with PoolingParams (an embedding) is one core
request that samples nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from folio.core.request import Request
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams, check_truncate_prompt_tokens
from folio.tokenizer import Tokenizer

PromptType = Union[str, dict]
Params = Union[SamplingParams, PoolingParams]
MAX_LOGPROBS = 20


def check_prompt_fits(prompt_len: int, max_model_len: int, field: str = "prompt") -> None:
    """The one rule for a prompt's length, wherever it is checked (the engine, and the server before tokenizing
    a token-id prompt and after tokenizing text): the prompt and at least one generated token must fit."""
    if prompt_len >= max_model_len:
        raise ValueError(f"{field} is {prompt_len} tokens long, but this model's maximum context length "
                         f"(max_model_len) is {max_model_len} tokens (the prompt and at least one generated token "
                         "must fit)")


@dataclass
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str] = None


def truncated(ids: list[int], keep: Optional[int], max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context holds beside one token
    to generate; None: all). A `keep` beyond the context is refused, as vLLM does: no prompt could be that long."""
    check_truncate_prompt_tokens(keep)
    if keep is None:
        return ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({keep}) must be at most the context length, max_model_len "
                         f"({max_model_len})")
    return ids[-(max(max_model_len - 1, 1) if keep == -1 else keep):]


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens as it starts the text, and as it follows a space, inside the text (the spelling
    models mostly write), where the space makes other tokens of the word rather than a token of its own."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [bare] + ([spaced] if spaced != bare and spaced[1:] != bare else [])
    return [sequence for sequence in sequences if sequence]  # (a word of no tokens bans nothing)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None) -> ProcessedPrompt:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = list(ids)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError(f"prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        ids = truncated(ids, truncate_prompt_tokens, self.max_model_len)
        check_prompt_fits(len(ids), self.max_model_len)
        return ProcessedPrompt(text, ids, salt)

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def _check_some_token_is_allowed(self, params: SamplingParams) -> None:
        """ValueError where allowed_token_ids leave no token to sample: all of them held back by min_tokens (the
        stop tokens), or all of them one-token bad words."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.min_tokens and allowed <= stops:
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens forbids until it is reached")
        if allowed <= {word[0] for word in params.bad_words_token_ids or () if len(word) == 1}:
            raise ValueError("allowed_token_ids holds only tokens that bad_words forbid")

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: Params,
                      priority: int, arrival_time: float) -> list[Request]:
        if isinstance(params, PoolingParams):
            return [Request(request_id, prompt.prompt_token_ids, None, priority=priority, arrival_time=arrival_time,
                            cache_salt=prompt.cache_salt, pooling_params=params)]
        self.check_params(params)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer,
                                                                                         params.bad_words))
        self._check_some_token_is_allowed(params)
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(child_request_id(request_id, i, params.n), params.clone_for_sample(i)) for i in range(params.n)]
            for _, child in children[1:]:
                child.prompt_logprobs = None  # the samples share one prompt: its logprobs come from the first
        return [Request(rid, prompt.prompt_token_ids, p, eos_token_ids=self.eos_token_ids, priority=priority,
                        arrival_time=arrival_time, cache_salt=prompt.cache_salt) for rid, p in children]
