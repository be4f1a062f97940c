"""Reasoning parsers: where a reasoning model's thinking ends and its answer begins (vLLM's `--reasoning-parser`).

Qwen3, QwQ, the DeepSeek-R1 family and GLM-4.5 think between `<think>` and `</think>` before they answer. Their
chat templates differ in where the opening tag goes: R1's and newer Qwen3 templates write `<think>` at the end of the
prompt, older Qwen3 templates and GLM-4.5's let the model write it, and a template with thinking switched off (Qwen3's
`enable_thinking: false`) writes a whole empty block, `<think>\\n\\n</think>\\n\\n`, into the prompt. One rule covers
them all: the output starts in reasoning unless the prompt's last turn already closed it (`starts_in_reasoning`);
an opening tag the model writes first is dropped; the output up to the closing tag is reasoning, the rest
content. An output cut off before the closing tag is all reasoning (as vLLM's parsers have it).

Magistral (Mistral's reasoning models, from Small 2507 on) thinks between `[THINK]` and `[/THINK]`, special tokens
of its tokenizer, and writes `[THINK]` itself when it thinks, as its system prompt asks; an answer that does not
open with it is all content. So a parser whose model opens the block itself (`model_opens`) starts in content, a
`[THINK]` at the output's start (after whitespace) opens the reasoning, and only a prompt that ends inside an open
block (an assistant prefill) starts in it. Its tags being special tokens, the server decodes its requests with
special tokens kept (`keeps_special_tokens`, as the Mistral tool-call format does); the end-of-sequence token that
ends an output stays out of the text all the same (folio.detokenizer).

Two parts of folio read it:
- the server splits each choice's text (`ReasoningSplitter`: `reasoning` beside `content` in chat, a reasoning
  item before the message in the Responses API; tool calls are read in the content only);
- the engine's structured outputs start their grammar after the closing tag (`EndTagWatcher` on token ids), so a
  constrained answer (a JSON schema, a tool call) still lets the model think first
  (folio.structured_output.reasoning_gate).

Whitespace at the seams is dropped: around the reasoning, and before the content. A streamed choice holds back
only what could still be the start of a tag or whitespace before one, so its pieces join to the full response's.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from folio.harmony import CHANNEL, END
from folio.harmony_split import HarmonySplitter, HarmonyTokens
from folio.reasoning_split import OutputSplitter, ReasoningSplit
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer

logger = logging.getLogger("folio")

# The most prompt tokens read back to see whether the prompt closed the reasoning.
_PROMPT_SCAN_TOKENS = 4096


@functools.lru_cache(maxsize=16)
def _tag_ids(tokenizer: Tokenizer, tag: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(tag, add_special_tokens=False))


def _ends_with(ids: list[int], end: int, tag: tuple[int, ...]) -> bool:
    """Whether ids[:end] ends with the tag's tokens."""
    return end >= len(tag) and ids[end - 1] == tag[-1] and tuple(ids[end - len(tag):end]) == tag


@dataclass(frozen=True)
class ReasoningParser:
    """The tags that delimit a model family's reasoning, and how the family writes them."""

    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    # The model writes the opening tag itself when it thinks, and an output without it is all content (Magistral);
    # otherwise the output starts in reasoning unless the prompt closed the block.
    model_opens: bool = False
    # The tags are special tokens, which decoding leaves out of the text unless told to keep them.
    keeps_special_tokens: bool = False
    # Grammars for this family's outputs write its reasoning themselves (harmony's analysis messages: the
    # tool-call format `openai` frames every constraint of a chat-shaped request), so no gate holds them back.
    frames_grammars: bool = False

    def check(self, tokenizer: Tokenizer) -> None:
        """At start: ValueError where the tokenizer hides the closing tag (a special token, which decoding leaves
        out of the text unless the parser keeps them: the answer would be read as reasoning), or where a model that
        opens the block itself has no one-token opening tag (its first token's mask allows that token beside the
        grammar's); a warning where the closing tag is several tokens (the model may spell it otherwise, and then
        the text ends the reasoning where the grammars do not see it)."""
        ids = self.end_tag_ids(tokenizer)
        if not self.keeps_special_tokens and tokenizer.decode(list(ids)) != self.end_tag:
            raise ValueError(f"reasoning_parser {self.name!r} reads {self.end_tag!r} in the text, and this model's "
                             "tokenizer makes it a special token, which decoding leaves out")
        if self.model_opens and len(self.start_tag_ids(tokenizer)) != 1:
            raise ValueError(f"reasoning_parser {self.name!r} needs {self.start_tag!r} as one token, and this "
                             "model's tokenizer does not have it")
        if len(ids) > 1:
            logger.warning("reasoning_parser %r: %r is %d tokens in this tokenizer, not one; structured outputs "
                           "start after these tokens only", self.name, self.end_tag, len(ids))

    def start_tag_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        return _tag_ids(tokenizer, self.start_tag)

    def end_tag_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The closing tag's tokens (one added token in the families above)."""
        return _tag_ids(tokenizer, self.end_tag)

    def reading(self, params: SamplingParams) -> SamplingParams:
        """The SamplingParams of a request whose output this parser splits: special tokens kept in the text where
        the tags are some (as ToolCallFormat.reading does for a format's markers)."""
        return replace(params, skip_special_tokens=False) if self.keeps_special_tokens else params

    def starts_in_reasoning(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the output starts inside the think block. Read back from the prompt's end: the closing tag
        first means the last turn closed it (thinking switched off, or an assistant prefill after the block); the
        opening tag means it is open; a special token (where a turn starts: an earlier turn's tags are not this
        one's), or the prompt's start, means the turn has no tag yet: open, unless the model opens it itself."""
        end, start = self.end_tag_ids(tokenizer), self.start_tag_ids(tokenizer)
        ids = list(prompt_token_ids[-_PROMPT_SCAN_TOKENS:])
        for i in range(len(ids), 0, -1):
            if _ends_with(ids, i, start):
                return True
            if _ends_with(ids, i, end):
                return False
            if ids[i - 1] in tokenizer.all_special_ids:
                break
        return not self.model_opens

    def splitter(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> "OutputSplitter":
        """A splitter for one choice of a request with this prompt."""
        return ReasoningSplitter(self, self.starts_in_reasoning(tokenizer, prompt_token_ids),
                                 self.end_tag_ids(tokenizer))


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """GPT-OSS's harmony format (folio.harmony): the reasoning is the analysis channel's messages, not a block
    between tags. The markers are special tokens, kept in the text; the grammars frame the analysis themselves
    (folio.entrypoints.openai.tool_harmony), so there is no closing tag for a gate to wait for."""

    start_tag: str = CHANNEL
    end_tag: str = END
    keeps_special_tokens: bool = True
    frames_grammars: bool = True

    def check(self, tokenizer: Tokenizer) -> None:
        """ValueError where the tokenizer lacks one of harmony's special tokens."""
        HarmonyTokens.of(tokenizer)

    def splitter(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> "OutputSplitter":
        return HarmonySplitter(HarmonyTokens.of(tokenizer), tokenizer, prompt_token_ids)


# vLLM's names (folio.config.REASONING_PARSER_NAMES). Qwen3's, DeepSeek-R1's and GLM-4.5's differ only in their
# templates, which starts_in_reasoning reads (GLM-4.5's prompt ends at <|assistant|>, or after an empty think block
# with thinking switched off: vLLM's glm45 reads the output as its deepseek_r1 does then, or as all content).
REASONING_PARSERS = {parser.name: parser for parser in (
    ReasoningParser("deepseek_r1"),
    ReasoningParser("glm45"),  # GLM-4.5, GLM-4.6
    ReasoningParser("mistral", "[THINK]", "[/THINK]", model_opens=True, keeps_special_tokens=True),  # Magistral
    HarmonyReasoningParser("openai_gptoss"),  # GPT-OSS: harmony's analysis channel
    ReasoningParser("qwen3"),
)}


def reasoning_parser(name: Optional[str]) -> Optional[ReasoningParser]:
    """The parser an engine option names (folio.config checks the name), None for none."""
    return None if name is None else REASONING_PARSERS[name]


class EndTagWatcher:
    """Finds where the closing tag's token ids first complete in a stream of output tokens."""

    def __init__(self, end_tag_ids: tuple[int, ...]) -> None:
        self.end_tag_ids = end_tag_ids
        self._recent: tuple[int, ...] = ()  # the last tokens seen, fewer than the tag's
        self.done = not end_tag_ids

    def find(self, token_ids: Sequence[int]) -> Optional[int]:
        """How many of `token_ids`, coming next, the reasoning would take, tag included, when the tag completes
        among them; None while it would not (and always once it has)."""
        if self.done:
            return None
        recent, width = self._recent, len(self.end_tag_ids)
        for i, token_id in enumerate(token_ids):
            recent = (recent + (token_id,))[-width:]
            if recent == self.end_tag_ids:
                return i + 1
        return None

    def feed(self, token_ids: Sequence[int]) -> Optional[int]:
        """find(), then follow the tokens."""
        taken = self.find(token_ids)
        if taken is not None:
            self.done = True
        elif not self.done:
            joined, keep = self._recent + tuple(token_ids), len(self.end_tag_ids) - 1
            self._recent = joined[max(0, len(joined) - keep):] if keep else ()
        return taken


class ReasoningSplitter:
    """One choice's output, fed as it is generated, split into reasoning and content: its text, and its tokens
    (reasoning tokens are counted for usage, and kept out of the message's logprobs in the Responses API; without
    the closing tag's ids, none are counted)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool, end_tag_ids: tuple[int, ...] = ()) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self._may_open = parser.model_opens and not in_reasoning  # no content yet: the opening tag may still come
        self._section_start = True  # nothing of the current section handed out yet: its leading whitespace goes
        self._held = ""  # text that may still turn out to be (the start of) a tag
        self._end_tag_ids = end_tag_ids
        self._tokens = EndTagWatcher(end_tag_ids if in_reasoning else ())

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningSplit:
        """The reasoning and content that `text` and its tokens (after what was fed before) let out; with `final`,
        everything."""
        out = ReasoningSplit()
        text, self._held = self._held + text, ""
        start, end = self.parser.start_tag, self.parser.end_tag
        while text:
            if not self.in_reasoning:
                if self._section_start:
                    text = text.lstrip()
                    self._section_start = not text
                if self._may_open and text:
                    opens = text.startswith(start)
                    if not opens and start.startswith(text) and not final:
                        self._held = text
                        break
                    self._may_open = False
                    if opens:  # the model opened the block: its tokens count from this piece's
                        text, self.in_reasoning, self._section_start = text[len(start):], True, True
                        self._tokens = EndTagWatcher(self._end_tag_ids)
                        continue
                out.content += text
                break
            if self._section_start:
                text = text.lstrip()
                if text.startswith(start):  # the model opened the block itself
                    text = text[len(start):]
                    continue
                if text and start.startswith(text) and not final:
                    self._held = text
                    break
            at = text.find(end)
            if at >= 0:
                self._add_reasoning(out, text[:at].rstrip())
                self.in_reasoning, self._section_start = False, True
                text = text[at + len(end):]
                continue
            if final:
                self._add_reasoning(out, text.rstrip())
                break
            kept = next((k for k in range(min(len(end) - 1, len(text)), 0, -1) if text.endswith(end[:k])), 0)
            head = text[:len(text) - kept]
            sent = head.rstrip()
            self._held = head[len(sent):] + text[len(head):]
            self._add_reasoning(out, sent)
            break
        if not self._tokens.done:
            taken = self._tokens.feed(token_ids)
            out.num_reasoning_tokens = len(token_ids) if taken is None else taken
        return out

    def _add_reasoning(self, out: ReasoningSplit, text: str) -> None:
        if text:
            out.reasoning += text
            self._section_start = False
