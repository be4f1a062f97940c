"""OpenAI's harmony format (GPT-OSS), read from the text of an output whose special tokens are kept.

A GPT-OSS turn is a run of messages. The prompt ends with `<|start|>assistant`, so the output opens with the first
message's header (or, after an assistant prefill, goes on in the prefilled message); each later message opens with
`<|start|>assistant` again:

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>

The header names the channel (analysis: reasoning; final: the answer; commentary: a call where the header names a
recipient, `to=...`, before or after the channel, else a preamble the user sees) and the body's content type
(`<|constrain|>json`, or a bare `json`). `<|return|>` and `<|call|>` end generation: they are end-of-sequence ids,
whose text the detokenizer leaves out, so a text also ends a message where it ends.

HarmonyReader turns such a text, fed in pieces of any split, into headers, body text and message ends, holding back
only what may still be the start of a marker. Text that is in no well-formed message (a header cut off or too
long, text between messages) comes out as Stray text, without markers, so that no marker ever reaches a client.
Both the reasoning parser (folio.reasoning_parser, `openai_gptoss`) and the tool-call reader
(folio.entrypoints.openai.tool_harmony, `openai`) are built on it; openai-harmony, which downloads its vocabulary
at run time, is not used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
_MARKER = re.compile("|".join(re.escape(marker) for marker in MARKERS))
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
FUNCTIONS = "functions."  # a recipient that names a function: a call's
HEADER_LIMIT = 512  # characters of a header (a role, a channel, a recipient of at most 64 + 10, a type)


@dataclass(frozen=True)
class Header:
    """A message's header: its channel, and its recipient where it has one."""

    channel: str
    recipient: Optional[str] = None

    def function(self) -> Optional[str]:
        """The function the recipient names, if it names one (the message is a call of it)."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):]

    def text(self) -> str:
        """The header as harmony writes it after `<|start|>assistant`, up to and with `<|message|>`."""
        to = "" if self.recipient is None else f" to={self.recipient}"
        return f"{CHANNEL}{self.channel}{to}{MESSAGE}"


@dataclass(frozen=True)
class Body:
    """A piece of the open message's text."""

    text: str


@dataclass(frozen=True)
class Closed:
    """The open message ended: by its end marker, by the next message's `<|start|>`, or (marker None) where the
    text ended (which an end-of-sequence marker, left out of the text, or max_tokens may have ended)."""

    marker: Optional[str]


@dataclass(frozen=True)
class Stray:
    """Text in no message, markers left out."""

    text: str


Event = Union[Header, Body, Closed, Stray]


def parse_header(text: str) -> Optional[Header]:
    """A header's text (between the message's start and `<|message|>`) as a Header; None where it names no
    channel."""
    before, found, after = text.partition(CHANNEL)
    words = _MARKER.sub(" ", after).split()
    if not found or not words:
        return None
    recipient = _RECIPIENT.search(_MARKER.sub(" ", text))
    return Header(words[0], None if recipient is None else recipient.group(1))


def held_marker_start(text: str) -> int:
    """Length of the longest end of text that may be the start of a marker."""
    at = text.rfind("<", max(0, len(text) - 12))
    if at == -1 or "|>" in text[at:]:
        return 0
    tail = text[at:]
    return len(tail) if any(marker.startswith(tail) for marker in MARKERS) else 0


class HarmonyReader:
    """One output's harmony text, piece by piece, as events; work per piece is its length (a header is held back
    whole until its `<|message|>`, at most HEADER_LIMIT characters)."""

    def __init__(self, opening: str = START) -> None:
        """opening: the prompt's text from its last `<|start|>`, the message the output writes or goes on: by
        default the start alone (the generation prompt's role aside), so the output opens with the header; an
        assistant prefill's, up to its text so far, so the output goes on in that message's body, whose header
        comes out first, as if the output had written it (or in its header, or between messages, where the
        prompt ends there)."""
        self._state = "between"  # header, body, between
        self._header = ""  # the header's text so far
        self._held = ""  # a possible start of a marker
        self._opened: list[Event] = []
        headers = [event for event in self.feed(opening) if isinstance(event, Header)]
        self._held = ""  # (the prompt's text is not the output's: it ends where a token, a marker too, does)
        self._opened = headers[-1:] if self._state == "body" else []  # the header to give first

    def feed(self, text: str, final: bool = False) -> list[Event]:
        out: list[Event] = self._opened
        self._opened = []
        text, self._held = self._held + text, ""
        while True:
            match = _MARKER.search(text)
            if match is None:
                keep = 0 if final else held_marker_start(text)
                self._text(text[:len(text) - keep], out)
                self._held = text[len(text) - keep:]
                break
            self._text(text[:match.start()], out)
            self._marker(match.group(), out)
            text = text[match.end():]
        if final:
            self._end(out)
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._state == "body":
            out.append(Body(text))
        elif self._state == "between":
            out.append(Stray(text))
        else:
            self._header += text
            if len(self._header) > HEADER_LIMIT:  # no header: its text is stray
                out.append(Stray(_MARKER.sub("", self._header)))
                self._state, self._header = "between", ""

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self._state == "header":
            if marker == MESSAGE:
                header = parse_header(self._header)
                if header is None:
                    out.append(Stray(_MARKER.sub("", self._header)))
                else:
                    out.append(header)
                self._state, self._header = "body" if header is not None else "between", ""
            elif marker in (CHANNEL, CONSTRAIN):
                self._header += marker
            else:  # a start or an end where a header should go on: what came of it is stray
                self._stray_header(out)
                self._state = "header" if marker == START else "between"
        elif marker == START or (marker == CHANNEL and self._state == "between"):
            if self._state == "body":
                out.append(Closed(START))
            self._state, self._header = "header", marker if marker == CHANNEL else ""
        elif self._state == "body" and marker in ENDS:
            out.append(Closed(marker))
            self._state = "between"
        # (any other marker is left out of the text)

    def _stray_header(self, out: list[Event]) -> None:
        if self._header:
            stray = _MARKER.sub("", self._header)
            if stray:
                out.append(Stray(stray))
        self._header = ""

    def _end(self, out: list[Event]) -> None:
        """The text ended: the open message with it; a header cut off is stray."""
        if self._state == "body":
            out.append(Closed(None))
        elif self._state == "header":
            self._stray_header(out)
        self._state = "between"
