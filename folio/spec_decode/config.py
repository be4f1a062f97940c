"""SpeculativeConfig: the `speculative_config` engine option, in vLLM's shape.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    folio serve --speculative-config '{"method": "suffix", "num_speculative_tokens": 6}'
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # the most drafts a request gets per step
    # ngram: the longest n-gram (prompt_lookup_max tokens) ending the request's tokens that occurred earlier in
    # them, down to prompt_lookup_min, is looked up; the tokens that followed it are the drafts
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix: how many finished requests' outputs stay indexed beside each request's own tokens
    suffix_cache_requests: int = 256
    # draft_model: a smaller model with the target's vocabulary (a Hugging Face folder or a .gguf file)
    model: Optional[str] = None
    # adaptive: each request's drafts shrink with its acceptance; no drafts while more than this many
    # requests decode together (decode is then compute-bound: verifying guesses costs what it saves)
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"speculative_config.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.method not in METHODS:
            fail("method", f"must be one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "suffix_cache_requests", "max_batch_size"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                fail(name, "must be an integer >= 1")
        if not (is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min):
            fail("prompt_lookup_max", f"must be an integer >= prompt_lookup_min ({self.prompt_lookup_min})")
        if (self.method == "draft_model") != (self.model is not None):
            fail("model", "is the draft model's path, given with method draft_model only")

    @classmethod
    def parse(cls, value: Union[None, str, dict[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """The option's value: a SpeculativeConfig, a dict of its fields, their JSON text, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s): {', '.join(unknown)}")
        if "method" not in value:
            raise ValueError("speculative_config needs a method: one of " + ", ".join(METHODS))
        return cls(**value)
