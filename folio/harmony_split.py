"""GPT-OSS's reasoning (`--reasoning-parser openai_gptoss`): the analysis channel's messages of a harmony output
(folio.harmony), split from the rest.

The reasoning is the analysis messages' text, as written (several join as they come, as vLLM gives them). What
is left stays harmony: each other message goes on as `<|start|>assistant`, its header and its text, for the
tool-call format `openai` (folio.entrypoints.openai.tool_harmony), which reads every output of such a server and
makes final and preamble text content and calls tool calls; text in no message is content as it is. So the
markers never reach a client, and a call stays a call whatever the tokens' split.

Reasoning tokens are counted on the token ids: those of analysis messages from their `<|message|>` to their end
marker, included (headers are the format's, not the reasoning's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from folio.harmony import CALL, END, MARKERS, MESSAGE, RETURN, START, Body, Closed, HarmonyReader, Header, \
    Stray, parse_header
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


class _ReasoningTokens:
    """Counts the reasoning tokens of an output, fed its token ids."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._start, self._message = tokens[START], tokens[MESSAGE]
        self._ends = frozenset(tokens[marker] for marker in (END, RETURN, CALL))
        self._header: list[int] = []
        self._body: Optional[bool] = None  # in a body: whether it is analysis; None in a header

    def count(self, token_ids: Sequence[int]) -> int:
        counted = 0
        for token_id in token_ids:
            if self._body is not None:
                counted += self._body
                if token_id in self._ends or token_id == self._start:
                    counted -= token_id == self._start
                    self._body, self._header = None, []
            elif token_id == self._message:
                header = parse_header(self._tokenizer.decode(self._header, skip_special_tokens=False))
                self._body = header is not None and header.channel == ANALYSIS
                counted += self._body
            elif token_id == self._start:
                self._header = []
            else:
                self._header = (self._header + [token_id])[-_HEADER_TOKENS:]
        return counted


class HarmonySplitter:
    """One choice's harmony output split into its reasoning and the rest (an OutputSplitter)."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer) -> None:
        self._reader = HarmonyReader()
        self._tokens = _ReasoningTokens(tokens, tokenizer)
        self._analysis = False  # the open message is analysis

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningSplit:
        out = ReasoningSplit(num_reasoning_tokens=self._tokens.count(token_ids))
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
                if not self._analysis and event.marker is not None:
                    content.append(event.marker)
                self._analysis = False
            elif isinstance(event, Stray):
                content.append(event.text)
        out.content = "".join(content)
        return out

