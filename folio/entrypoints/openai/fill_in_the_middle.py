"""Fill-in-the-middle: the prompt for `suffix` on /v1/completions, for code models trained to fill a gap.

Such a model reads the code before the gap, the code after it, and then writes the middle: "prefix, suffix,
middle" order, each part opened by a special token of its vocabulary. Models without those tokens were never
trained to do this, so a suffix is refused for them rather than pasted into the prompt.
"""

from __future__ import annotations

from folio.tokenizer import Tokenizer

# (prefix, suffix, middle) markers of the two families in use.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, DeepSeek-style pipes
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
)


def fim_prompt_ids(tokenizer: Tokenizer, prefix: str, suffix: str) -> list[int]:
    """Token ids of a prompt asking for the text between prefix and suffix; ValueError naming `suffix` when the
    tokenizer has no fill-in-the-middle tokens."""
    for markers in FIM_TOKENS:
        if all(tokenizer.backend.token_to_id(m) is not None for m in markers):
            start, middle_of_suffix, end = markers
            # the markers are added tokens, so the text is split at them and each part tokenized on its own
            return tokenizer.encode(f"{start}{prefix}{middle_of_suffix}{suffix}{end}")
    names = " or ".join("/".join(markers) for markers in FIM_TOKENS)
    raise ValueError(f"suffix is not supported by this model: its tokenizer has no fill-in-the-middle tokens "
                     f"({names})")
