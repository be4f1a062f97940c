"""GPT-OSS's reasoning (`--reasoning-parser openai_gptoss`): the analysis channel's messages of a harmony output
(folio.harmony), split from the rest.

The reasoning is the analysis messages' text, as written (several join as they come, as vLLM gives them). What
is left stays harmony: each other message goes on as `<|start|>assistant`, its header and its text, for the
tool-call format `openai` (folio.entrypoints.openai.tool_harmony), which reads every output of such a server and
makes final and preamble text content and calls tool calls; text in no message is content as it is. So the
markers never reach a client, and a call stays a call whatever the tokens' split.

The tokens are told apart on their ids: the reasoning tokens are those of analysis messages from their
`<|message|>` to their end marker, included (headers are the format's, not the reasoning's); the content's are
those of the text the client gets as content, without the headers, markers and calls around it, so that the
logprobs the chat's content has are its own tokens' (its reasoning's are not given, with include_reasoning or
without: there are no tags among them to tell it from the content, as a think block's are).

After an assistant prefill (continue_final_message) the output goes on in the prefilled message: the text and the
tokens are read from where the prompt's last message leaves off, so that what follows a final message's text is
content, and an analysis message's reasoning; the content handed on opens with the prefilled message's header
where it is not analysis, so the tool-call reader after it needs no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from folio.harmony import CALL, CHANNEL, END, ENDS, MARKERS, MESSAGE, RETURN, START, Body, Closed, HarmonyReader, \
    Header, Stray, parse_header
from folio.reasoning_split import ReasoningSplit
from folio.tokenizer import Tokenizer

ANALYSIS = "analysis"
_HEADER_TOKENS = 64  # header tokens kept to read its channel (a header is a few tokens)


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's markers in the model's tokenizer."""

    ids: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "HarmonyTokens":
        """ValueError where a marker is not one token of the tokenizer (not a GPT-OSS tokenizer)."""
        ids = {marker: tokenizer.backend.token_to_id(marker) for marker in MARKERS}
        missing = [marker for marker, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(f"GPT-OSS's harmony format needs the special tokens {', '.join(missing)}, which this "
                             "model's tokenizer does not have")
        return cls(ids)

    def __getitem__(self, marker: str) -> int:
        return self.ids[marker]


_REASONING, _CONTENT = "reasoning", "content"  # what a token wrote (None: the format's, or a call's)


def prompt_opening(tokens: HarmonyTokens, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt's tokens from its last `<|start|>`: the message the output writes (the generation prompt's
    `<|start|>assistant`) or goes on (an assistant prefill's, continue_final_message); a start alone where the
    prompt has none."""
    ids = list(prompt_token_ids)
    try:
        return ids[len(ids) - 1 - ids[::-1].index(tokens[START]):]
    except ValueError:
        return [tokens[START]]


class _TokenParts:
    """What each token of an output wrote, read on its ids as HarmonyReader reads its text: reasoning (an analysis
    message, from its `<|message|>` to its end marker: the reasoning tokens), content (the text of a message to no
    function, or in no message: what the client gets as content), or neither (headers, calls, and special tokens:
    the markers, and the end-of-sequence token, whose text the output leaves out). Each token is told as it comes,
    so where only a malformed output makes them differ, the text reader has the last word on the text: a header
    it finds stray (cut off, too long) has its tokens taken for the format's here, and a message to a function
    the request has not for a call's."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer, opening: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._start, self._message, self._channel = tokens[START], tokens[MESSAGE], tokens[CHANNEL]
        self._ends = frozenset(tokens[marker] for marker in (END, RETURN, CALL))
        self._special = frozenset(tokenizer.all_special_ids) | frozenset(tokens.ids.values())
        self._state = "between"  # header, between, or in a body what its text is: reasoning, content, call
        self._header: list[int] = []
        self.parts(opening)

    def parts(self, token_ids: Sequence[int]) -> list[Optional[str]]:
        return [self._part(token_id) for token_id in token_ids]

    def _part(self, token_id: int) -> Optional[str]:
        state = self._state
        if token_id == self._start or (token_id == self._channel and state == "between"):
            self._state, self._header = "header", [token_id]
            return None
        if token_id in self._ends:
            self._state = "between"
            return _REASONING if state == _REASONING else None
        if state == "header":
            if token_id == self._message:
                header = parse_header(self._tokenizer.decode(self._header, skip_special_tokens=False))
                self._state = self._body(header)
                return _REASONING if self._state == _REASONING else None
            self._header = (self._header + [token_id])[-_HEADER_TOKENS:]
            return None
        if token_id in self._special:
            return None
        return _CONTENT if state == "between" else None if state == "call" else state

    @staticmethod
    def _body(header: Optional[Header]) -> str:
        """What the text of a message with this header is ("between" where it has none: its text is stray)."""
        if header is None:
            return "between"
        return _REASONING if header.channel == ANALYSIS else "call" if header.function() is not None else _CONTENT


class HarmonySplitter:
    """One choice's harmony output split into its reasoning and the rest (an OutputSplitter), read from where the
    prompt leaves off (prompt_opening)."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        opening = prompt_opening(tokens, prompt_token_ids)
        self._reader = HarmonyReader(tokenizer.decode(opening, skip_special_tokens=False))
        self._tokens = _TokenParts(tokens, tokenizer, opening)
        self._analysis = False  # the open message is analysis

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningSplit:
        parts = self._tokens.parts(token_ids)
        out = ReasoningSplit(num_reasoning_tokens=parts.count(_REASONING),
                             content_tokens=[i for i, part in enumerate(parts) if part == _CONTENT])
        content: list[str] = []
        for event in self._reader.feed(text, final):
            if isinstance(event, Header):
                self._analysis = event.channel == ANALYSIS
                if not self._analysis:
                    content.append(START + "assistant" + event.text())
            elif isinstance(event, Body):
                if self._analysis:
                    out.reasoning += event.text
                else:
                    content.append(event.text)
            elif isinstance(event, Closed):
                if not self._analysis and event.marker in ENDS:
                    content.append(event.marker)
                self._analysis = False
            elif isinstance(event, Stray):
                content.append(event.text)
        out.content = "".join(content)
        return out
