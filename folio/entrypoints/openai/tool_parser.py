"""ToolCallParser: reads Hermes-format tool calls (folio.entrypoints.openai.tool_grammar) out of a choice's text as
it streams, turning them into OpenAI's tool-call deltas.

Text outside `<tool_call>...</tool_call>` is content (a trailing "<tool_c" waits until it is known not to open a
call; whitespace after a call is dropped). Inside a call, the first delta carries the call's id, type and name
as soon as `{"name": "...", "arguments": ` has arrived, then each delta carries the next piece of the arguments'
JSON text, as OpenAI streams them; closing braces at the end are held back until the call closes, since the last
one closes the call's object rather than the arguments. A call the grammar did not write (a call in another key
order) is sent whole when it closes; one that does not parse, or names no function of the request's tools, stays
content. When the text ends (`final`), what was held back goes out: a call whose object is whole (the text
stopped at a stop string or end of sequence before </tool_call>) is a call like any other, one cut inside its
arguments keeps them as they are, and one cut before its name is the content it was.

Work per piece of text: the open call's text is copied and searched once per feed, so a call of n characters
costs O(n^2) in all; at 20,000 tokens of arguments, about 2 s over the whole generation (measured on the AVX2 EPYC),
which takes far longer on a CPU.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Collection, Optional, Union

from folio.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from folio.entrypoints.openai.tool_grammar import CALL_CLOSE, CALL_OPEN

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CLOSERS = " \t\r\n}"  # what may end a call's arguments and close its object (JSON's whitespace, braces)


@dataclass(frozen=True)
class CallEnd:
    """A call's closing tag came: every delta of call `index` is out."""

    index: int


Piece = Union[str, DeltaToolCall, CallEnd]  # content, a piece of a call, a call's end: in the order written


def _pending_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _is_text(value: object) -> bool:
    """A str that is valid Unicode text (a JSON escape can decode to a lone surrogate, which no response holds)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _call_object(text: str) -> Optional[dict]:
    """text as a call's JSON object ({"name": ..., "arguments": ...}), or None."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):  # (a model without the tools' grammar can nest without end)
        return None
    return call if isinstance(call, dict) and "name" in call else None


@dataclass
class _Call:
    """The call being read: its index among the choice's calls, and how much of its arguments went out."""

    index: int
    names: Optional[Collection[str]]  # the functions a call may name (None: any)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments_start: Optional[int] = None  # where the arguments begin in the call's text, once the header is in
    sent: int = 0  # characters of the arguments handed out

    def update(self, body: str, closed: bool, final: bool) -> list[DeltaToolCall]:
        """Deltas for the call's text so far (`body`, everything after <tool_call>); closed: it is all there;
        final: no more text will come, so nothing is held back."""
        deltas = []
        if self.arguments_start is None:
            header = _HEADER.match(body)
            name = None if header is None else self._name(header.group(1))
            if name is None:
                return self._whole(body) if closed else []
            self.arguments_start = header.end()
            deltas.append(self._opening(name))
        arguments = body[self.arguments_start:].lstrip()
        if closed:
            arguments = arguments.rstrip().removesuffix("}").rstrip()  # the call's own closing brace
        elif not final:  # what may yet turn out to close the call: braces, whitespace, the start of </tool_call>
            arguments = arguments[:len(arguments) - _pending_prefix(arguments, CALL_CLOSE)]
            arguments = arguments[:len(arguments.rstrip(_CLOSERS))]
        if len(arguments) > self.sent:
            deltas.append(DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments=arguments[self.sent:])))
            self.sent = len(arguments)
        return deltas

    def _name(self, literal: str) -> Optional[str]:
        """The function a header's JSON string names, if it is one the call may name."""
        try:
            name = json.loads(literal)
        except ValueError:
            return None
        return name if self._may_name(name) else None

    def _may_name(self, name: object) -> bool:
        return _is_text(name) and (self.names is None or name in self.names)

    def _opening(self, name: str) -> DeltaToolCall:
        return DeltaToolCall(index=self.index, id=self.id, type="function",
                             function=DeltaFunctionCall(name=name, arguments=""))

    def _whole(self, body: str) -> list[DeltaToolCall]:
        """A call the header did not match (another key order), sent whole once it closed."""
        call = _call_object(body)
        if call is None or not self._may_name(call["name"]):
            return []
        arguments = call.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        if not _is_text(text):
            text = json.dumps(arguments)  # escaped: the same value, in ASCII
        opening = self._opening(call["name"])
        opening.function.arguments = text
        return [opening]


class ToolCallParser:
    """One choice's parser: feed it each new piece of text; `final` on the last one flushes what waits.

    names: the functions of the request's tools; a call naming another is content (None: any name)."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        self._names = None if names is None else frozenset(names)
        self._buffer = ""  # text not handed out yet: a possible tag start, or the open call's text
        self._call: Optional[_Call] = None  # the call being read
        self._after_call = False  # whether the content so far since the last call's end is whitespace
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call deltas that `text` completes (their order between them is `pieces`')."""
        pieces = self.pieces(text, final)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, DeltaToolCall)]

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        """What `text` completes, in the order it was written: content, call deltas, and each call's end."""
        self._buffer += text
        out: list[Piece] = []
        while True:
            if self._call is None:
                start = self._buffer.find(CALL_OPEN)
                if start == -1:
                    keep = 0 if final else _pending_prefix(self._buffer, CALL_OPEN)
                    self._content(out, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_OPEN):]
                self._call = _Call(self.num_calls, self._names)
            end = self._buffer.find(CALL_CLOSE)
            body = self._buffer if end == -1 else self._buffer[:end]
            if end == -1 and final:
                whole = body.rstrip()
                whole = whole[:len(whole) - _pending_prefix(whole, CALL_CLOSE)]
                if _call_object(whole) is not None:  # stopped before </tool_call>, its object whole: a call
                    body, end = whole, len(self._buffer)
            new = self._call.update(body, closed=end != -1, final=final)
            if end == -1:
                if final and self._call.arguments_start is None:  # cut before its name: the text it was
                    self._content(out, CALL_OPEN + body)
                    self._buffer, self._call = "", None
                else:
                    out += new  # a call cut short (max_tokens) keeps what it streamed
                return out
            if new or self._call.arguments_start is not None:
                out += new
                out.append(CallEnd(self._call.index))
                self.num_calls += 1
                self._after_call = True
            else:
                self._content(out, CALL_OPEN + body + CALL_CLOSE)  # not a call after all
            self._buffer = self._buffer[end + len(CALL_CLOSE):]
            self._call = None

    def _content(self, out: list[Piece], text: str) -> None:
        """Content outside calls, without the whitespace that follows a call (however the tokens split it)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(text)


def join_tool_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The whole calls of a non-streamed response, from the deltas a stream would have carried."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name,
                                                                              arguments=delta.function.arguments or ""))
        else:
            call.function.arguments += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]
