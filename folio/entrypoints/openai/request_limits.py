"""Cheap checks made before expensive work: sizes a request may have, checked before it is tokenized or queued.

A prompt's tokens cannot be counted without tokenizing it, which for a body of megabytes takes seconds, but
its characters can: no token stands for more characters than the longest in the vocabulary, so a text longer
than max_model_len of them cannot fit and is refused unread. A token-id list is refused by its length before
its ids are looked at. The other limits (server options) bound what a request's parameters cost per step.
Every check raises ValueError naming the field, which the routes answer with a 400.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from folio.engine.input_processor import check_prompt_fits
from folio.entrypoints.openai.server_options import ServerOptions
from folio.tokenizer import Tokenizer


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token stands for. A byte-level token's vocabulary string has a symbol per byte,
    and a character is at least one byte, so its length bounds the characters too."""
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


@dataclass(frozen=True)
class RequestLimits:
    options: ServerOptions
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int

    @classmethod
    def build(cls, options: ServerOptions, tokenizer: Tokenizer, max_model_len: int,
              vocab_size: int) -> "RequestLimits":
        return cls(options, max_model_len, vocab_size, max_model_len * longest_token_chars(tokenizer))

    def for_prompts(self, truncate_prompt_tokens: Optional[int]) -> "RequestLimits":
        """The limits of a request's prompts: these, or where the request truncates its prompts
        (truncate_prompt_tokens) none on their length, which truncation brings within the context (the body's
        size still bounds them)."""
        if truncate_prompt_tokens is None:
            return self
        return dataclasses.replace(self, max_model_len=sys.maxsize, max_prompt_chars=sys.maxsize)

    def text(self, text: str, field: str = "prompt") -> None:
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"{field} is {len(text)} characters long, more than the {self.max_prompt_chars} that "
                             f"could fit in this model's maximum context length of {self.max_model_len} tokens")

    def token_ids(self, ids: Sequence[int], field: str = "prompt") -> None:
        check_prompt_fits(len(ids), self.max_model_len, field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{field} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def prompt(self, prompt: Union[str, Sequence[int]], field: str = "prompt") -> None:
        """A prompt as text or as token ids."""
        if isinstance(prompt, str):
            self.text(prompt, field)
        else:
            self.token_ids(prompt, field)

    def prompt_count(self, count: int, field: str = "prompt") -> None:
        if count > self.options.max_prompts_per_request:
            raise ValueError(f"{field} holds {count} prompts; this server takes at most "
                             f"{self.options.max_prompts_per_request} per request")

    def stop(self, stop: Optional[Sequence[str]], field: str = "stop") -> None:
        """Strings the output is matched against: stop, and bad_words (each checked at every step)."""
        stop = stop or ()
        if len(stop) > self.options.max_stop_strings:
            raise ValueError(f"{field} holds {len(stop)} strings; this server takes at most "
                             f"{self.options.max_stop_strings}")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.options.max_stop_string_chars:
            raise ValueError(f"{field} holds a string of {longest} characters; this server takes at most "
                             f"{self.options.max_stop_string_chars}")

    def logit_bias(self, logit_bias: Optional[dict]) -> None:
        if logit_bias and len(logit_bias) > self.options.max_logit_bias:
            raise ValueError(f"logit_bias has {len(logit_bias)} entries; this server takes at most "
                             f"{self.options.max_logit_bias}")

    def tools(self, tools: Optional[Sequence]) -> None:
        if tools and len(tools) > self.options.max_tools:
            raise ValueError(f"tools holds {len(tools)} tools; this server takes at most {self.options.max_tools}")

    def token_id_set(self, ids: Optional[Sequence[int]], field: str) -> None:
        """A set of token ids (stop_token_ids, allowed_token_ids): as many as the vocabulary has at most (more would
        be repeats)."""
        if ids and len(ids) > self.vocab_size:
            raise ValueError(f"{field} holds {len(ids)} ids, more than the vocabulary's {self.vocab_size}")
