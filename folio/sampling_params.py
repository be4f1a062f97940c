"""SamplingParams: how one request is decoded, in vLLM's names and conventions.

Every field is validated at construction so that a bad value fails with a ValueError naming the field,
before the request reaches the engine (and can never take down another request).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

from folio.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


def check_truncate_prompt_tokens(value: object) -> None:
    """ValueError unless value is None, -1 or a positive integer (the server checks a request's before its
    SamplingParams exist: it truncates the prompt before checking its length)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if value is not None and not (is_int and (value == -1 or value >= 1)):
        raise ValueError(f"truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1, got {value!r}")


@dataclass
class SamplingParams:
    """Decoding parameters of one request.

    temperature 0 means greedy. top_k 0 or -1 means disabled. seed makes the request's random draws
    depend only on the seed and its own tokens, whatever else shares the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None  # the only tokens that may be sampled
    bad_words: Optional[list[str]] = None  # words the output may not contain (vLLM's rule: BadWords)
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: Optional[int] = None  # the prompt's last k tokens (-1: as many as fit beside one more)
    structured_outputs: Optional[StructuredOutputsParams] = None  # a JSON schema, regex, choice or grammar to follow
    # bad_words as token sequences, with and without a leading space: the engine tokenizes them (InputProcessor)
    bad_words_token_ids: Optional[list[list[int]]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  name, "must be a finite number")
        check(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "logprobs", "must be an integer >= 0")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
              "prompt_logprobs", "must be an integer >= 0")
        check(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
              "must be a 64-bit integer")
        if self.logit_bias and not all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {self.logit_bias!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must hold non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must hold token ids >= 0")
        check(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            is_int(t) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
              "must be a non-empty list of token ids >= 0")
        check(self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
              "must hold words that are not blank")
        check(self.bad_words_token_ids is None or all(
            isinstance(word, list) and word and all(is_int(t) and t >= 0 for t in word)
            for word in self.bad_words_token_ids), "bad_words_token_ids", "must hold non-empty lists of token ids")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where the "
                             "output may end")
        for name in ("allowed_token_ids", "bad_words"):
            if self.structured_outputs is not None and getattr(self, name) is not None:
                raise ValueError(f"{name} cannot be combined with structured_outputs: the grammar decides which "
                                 "tokens may come (together they could leave none)")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the text)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone_for_sample(self, index: int) -> "SamplingParams":
        """Params of the index-th of n independent samples: n=1, and a distinct seed when seeded."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
