"""Reading tool calls out of a choice's text as it streams, as OpenAI's tool-call deltas: ToolCallReader, what
every tool-call format's reader is (with the pieces and helpers they share), and HermesToolCallReader, the Hermes
format's (folio.entrypoints.openai.tool_grammar writes its grammars).

Text outside `<tool_call>...</tool_call>` is content (a trailing "<tool_c" waits until it is known not to open a
call; whitespace after a call is dropped). Inside a call, the first delta carries the call's id, type and name
as soon as `{"name": "...", "arguments": ` has arrived, then each delta carries the next piece of the arguments'
JSON text, as OpenAI streams them; closing braces at the end are held back until the call closes, since the last
one closes the call's object rather than the arguments. A call the grammar did not write (a call in another key
order) is sent whole when it closes, its arguments' text as written; one that does not parse, or names no
function of the request's tools, stays content. When the text ends (`final`), what was held back goes out: a call
whose object is whole (the text stopped at a stop string or end of sequence before </tool_call>) is a call like
any other, one cut inside its arguments keeps them as they are, and one cut before its name is the content it was.

Work per piece of text is the piece's length (a call's text is joined whole only where it is needed whole), so a
long call's arguments stream at a constant cost a token.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Collection, Optional, Union

from folio.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from folio.entrypoints.openai.tool_grammar import CALL_CLOSE, CALL_OPEN

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
JSON_SPACE = " \t\r\n"  # JSON's whitespace (str.strip() would also take Unicode spaces, which JSON does not allow)
_SPACES = re.compile(f"[{JSON_SPACE}]*")
_CLOSERS = JSON_SPACE + "}"  # what may end a call's arguments and close its object
HEAD_LIMIT = 1024  # characters of a call's start searched for its header while it streams (a name is at most 64)


@dataclass(frozen=True)
class CallEnd:
    """A call's closing tag came: every delta of call `index` is out."""

    index: int


Piece = Union[str, DeltaToolCall, CallEnd]  # content, a piece of a call, a call's end: in the order written


def pending_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def until_tag(text: str, tag: str, final: bool) -> tuple[str, str, bool]:
    """text split at tag's first occurrence: what comes before it, what follows it, True; where tag does not occur,
    the text that cannot be part of it (all of it when final), the end held back as its possible start, False."""
    at = text.find(tag)
    if at != -1:
        return text[:at], text[at + len(tag):], True
    keep = 0 if final else pending_prefix(text, tag)
    return text[:len(text) - keep], text[len(text) - keep:], False


class BracketEnd:
    """Follows a bracketed text as it streams (a JSON object, a Python list), from its opening bracket, to find where
    it closes: where its brackets outside strings balance. A backslash in a string escapes the next character, also
    across pieces. Work per piece is its length."""

    def __init__(self, brackets: str = "{}", quotes: str = '"') -> None:
        """brackets: opening and closing brackets, in pairs ("{}", "[](){}"); quotes: what opens and closes a
        string."""
        self._opening, self._quotes = brackets[0::2], quotes
        self._significant = re.compile("[" + re.escape(brackets + quotes) + r"\\]")
        self._depth = 0
        self._quote = ""  # the quote of the string the text is in, if any
        self._escaped = False  # a backslash in a string ended the last piece: the next character is escaped

    def feed(self, text: str) -> int:
        """The index just past the closing bracket in text, or -1 while the text stays open."""
        i = 0
        if self._escaped and text:  # (an empty piece leaves the escape pending)
            self._escaped, i = False, 1
        while (match := self._significant.search(text, i)) is not None:
            i, char = match.end(), match.group()
            if self._quote:
                if char == "\\":
                    self._escaped, i = i == len(text), i + 1
                elif char == self._quote:
                    self._quote = ""
            elif char in self._quotes:
                self._quote = char
            elif char in self._opening:
                self._depth += 1
            elif char != "\\":
                self._depth -= 1
                if self._depth == 0:
                    return i
        return -1


def _is_text(value: object) -> bool:
    """A str that is valid Unicode text (a JSON escape can decode to a lone surrogate, which no response holds)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def may_name(names: Optional[Collection[str]], name: object) -> bool:
    """Whether a call may name `name`: text, and one of the request's functions (names None: any)."""
    return _is_text(name) and (names is None or name in names)


def arguments_text(arguments: object) -> str:
    """Parsed arguments as the JSON text a call carries (escaped to ASCII where the text would not be valid
    Unicode: a JSON escape can decode to a lone surrogate)."""
    text = json.dumps(arguments, ensure_ascii=False)
    return text if _is_text(text) else json.dumps(arguments)


@dataclass(frozen=True)
class JsonNumber:
    """A JSON number as its text. Read as Python's int or float, a number would change (1.0000000000000000001 is
    1.0, 1e999 is inf, which no JSON text holds) or fail (an integer past Python's 4300 digits), and written back
    it would not be the number the model wrote: readers send a value's text as written, and read numbers as
    this only to check what kind of value a text is."""

    text: str

    def is_integer(self) -> bool:
        """Whether the number is an integer (JSON Schema's "integer": 1.0 and 1e2 are)."""
        try:
            number = Decimal(self.text)
            return number == number.to_integral_value()
        except ArithmeticError:  # an exponent past Decimal's: an integer where it is positive
            return "-" not in self.text.lower().partition("e")[2]


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_int=JsonNumber, parse_float=JsonNumber, parse_constant=_refuse_constant)


def read_json(text: str) -> object:
    """text's JSON value, numbers as JsonNumber; ValueError where text is not JSON (Python's NaN and Infinity
    included, and nesting deeper than Python recurses)."""
    try:
        return _DECODER.decode(text)
    except RecursionError as e:
        raise ValueError("nested too deep") from e


def json_members(text: str) -> Optional[dict[str, tuple[object, str]]]:
    """The members of the JSON object that text is (whitespace around it allowed), each key's value (read_json's)
    and its text as written, so that a call's arguments go out as the model wrote them; None where text is not a
    JSON object. A key written twice is its last value's, as JSON readers take it."""
    members: dict[str, tuple[object, str]] = {}
    i = _SPACES.match(text).end()
    if not text.startswith("{", i):
        return None
    i = _SPACES.match(text, i + 1).end()
    if text.startswith("}", i):
        return members if _SPACES.fullmatch(text, i + 1) else None
    try:
        while True:
            if not text.startswith('"', i):
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = _SPACES.match(text, i).end()
            if not text.startswith(":", i):
                return None
            start = _SPACES.match(text, i + 1).end()
            value, i = _DECODER.raw_decode(text, start)
            members[key] = (value, text[start:i])
            i = _SPACES.match(text, i).end()
            if text.startswith("}", i):
                break
            if not text.startswith(",", i):
                return None
            i = _SPACES.match(text, i + 1).end()
    except (ValueError, RecursionError):
        return None
    return members if _SPACES.fullmatch(text, i + 1) else None


def new_call_id() -> str:
    """A new call id, of the shape OpenAI's have."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_opening(index: int, name: str, arguments: str = "", call_id: Optional[str] = None) -> DeltaToolCall:
    """A call's first delta: its id (a new one where none is given), type and name, and the arguments' first
    text."""
    return DeltaToolCall(index=index, id=call_id or new_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def _call_object(text: str) -> Optional[dict[str, tuple[object, str]]]:
    """text as a call's JSON object ({"name": ..., "arguments": ...}): its members (json_members'), or None."""
    call = json_members(text)
    return call if call is not None and "name" in call else None


@dataclass
class _Call:
    """The call being read, fed its text piece by piece. Work per piece is the piece's length: the text is kept as
    parts and joined only where the whole is needed (a call sent whole, the end of the text); the header is looked
    for in the call's first HEAD_LIMIT characters; once it is in, only the arguments' held-back end is kept."""

    index: int
    names: Optional[Collection[str]]  # the functions a call may name (None: any)
    id: str = field(default_factory=new_call_id)
    parts: list[str] = field(default_factory=list)  # the call's text so far
    head: Optional[str] = ""  # its start while the header may still come; None once it cannot
    named: bool = False  # the header came: the opening delta went out
    unsent: str = ""  # after the header: the arguments' text not handed out (what may yet close the call)
    sent_any: bool = False  # some of the arguments went out (their leading whitespace is dropped before)
    tail: str = ""  # the text's last characters, for a closing tag split between pieces

    def feed(self, text: str, final: bool) -> tuple[list[DeltaToolCall], Optional[str]]:
        """The deltas `text` completes, and once the call is over (its closing tag, or at the end of the text its
        object whole) the text after it; None while it is open."""
        window = self.tail + text
        end = window.find(CALL_CLOSE)
        if end != -1:
            own = end - len(self.tail)  # (negative: the tag began in earlier text, which this takes back)
            self._append(text[:max(own, 0)])
            self._take_back(max(-own, 0))
            return self._close(), window[end + len(CALL_CLOSE):]
        self._append(text)
        if not final:
            return self._advance(), None
        body = "".join(self.parts)
        whole = body.rstrip()
        whole = whole[:len(whole) - pending_prefix(whole, CALL_CLOSE)]
        if _call_object(whole) is not None:  # stopped before </tool_call>, its object whole: a call
            self._take_back(len(body) - len(whole))
            return self._close(), ""
        return self._cut(), None

    def body(self) -> str:
        return "".join(self.parts)

    def _append(self, text: str) -> None:
        if not text:
            return
        self.parts.append(text)
        self.tail = (self.tail + text)[-(len(CALL_CLOSE) - 1):]
        if self.named:
            self.unsent += text
        elif self.head is not None:
            self.head += text

    def _take_back(self, count: int) -> None:
        """Drop the text's last `count` characters (the start of the closing tag, or what follows a whole object):
        they were held back, never handed out."""
        if count:
            self.parts = ["".join(self.parts)[:-count]]
            if self.named:
                self.unsent = self.unsent[:-count]
            elif self.head is not None:
                self.head = self.head[:-count]

    def _advance(self) -> list[DeltaToolCall]:
        """The opening once the header is in, then the arguments but for what may yet close the call: braces,
        whitespace, the start of </tool_call>."""
        deltas = [] if self.named else self._header(self.head)
        if not self.named:
            return deltas
        held = self.unsent[:len(self.unsent) - pending_prefix(self.unsent, CALL_CLOSE)]
        return deltas + self._send(len(held.rstrip(_CLOSERS)))

    def _close(self) -> list[DeltaToolCall]:
        """The rest of the arguments, but for the call's own closing brace; a call the header did not match sent
        whole."""
        deltas = [] if self.named else self._header(self.body())
        if not self.named:
            return self._whole(self.body())
        rest = self.unsent.rstrip().removesuffix("}").rstrip()
        return deltas + self._send(len(rest), rest)

    def _cut(self) -> list[DeltaToolCall]:
        """The text ended inside the call: all of its arguments as they are (none if its header never came)."""
        deltas = [] if self.named else self._header(self.body())
        if not self.named:
            return []
        return deltas + self._send(len(self.unsent))

    def _header(self, text: Optional[str]) -> list[DeltaToolCall]:
        """The opening delta where `text` starts with a header naming a function the call may name."""
        header = None if text is None else _HEADER.match(text)
        name = None if header is None else self._name(header.group(1))
        if name is None:
            if text is not None and (header is not None or len(text) > HEAD_LIMIT):
                self.head = None  # a refused name, or no header where one fits: none will come
            return []
        self.named, self.head = True, None
        self.unsent = text[header.end():]
        return [self._opening(name)]

    def _send(self, count: int, text: Optional[str] = None) -> list[DeltaToolCall]:
        """A delta with the first `count` characters of the unsent arguments (of `text` instead where given);
        the rest stays unsent."""
        source = self.unsent if text is None else text
        if not self.sent_any:
            stripped = source.lstrip()
            count -= len(source) - len(stripped)
            source = stripped
        self.unsent = source[max(count, 0):] if text is None else ""
        if count <= 0:
            return []
        self.sent_any = True
        return [DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments=source[:count]))]

    def _name(self, literal: str) -> Optional[str]:
        """The function a header's JSON string names, if it is one the call may name."""
        try:
            name = json.loads(literal)
        except ValueError:
            return None
        return name if may_name(self.names, name) else None

    def _opening(self, name: str) -> DeltaToolCall:
        return call_opening(self.index, name, call_id=self.id)

    def _whole(self, body: str) -> list[DeltaToolCall]:
        """A call the header did not match (another key order), sent whole once it closed: its arguments' text as
        written (a JSON string's text where the arguments are one)."""
        call = _call_object(body)
        if call is None or not may_name(self.names, call["name"][0]):
            return []
        arguments, written = call.get("arguments", ({}, "{}"))
        return [call_opening(self.index, call["name"][0], arguments if _is_text(arguments) else written,
                             self.id)]


class ToolCallReader(ABC):
    """What reads one choice's tool calls, whatever their format: feed it each new piece of text; `final` on the
    last one flushes what waits."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._after_call = False  # whether the content since the last call's end is whitespace so far

    @abstractmethod
    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        """What `text` completes, in the order it was written: content, call deltas, and each call's end."""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call deltas that `text` completes (their order between them is `pieces`')."""
        pieces = self.pieces(text, final)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, DeltaToolCall)]

    def _content(self, out: list[Piece], text: str) -> None:
        """Content outside calls, without the whitespace that follows a call (however the tokens split it)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(text)


class HermesToolCallReader(ToolCallReader):
    """The Hermes format's reader.

    names: the functions of the request's tools; a call naming another is content (None: any name)."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._outside = ""  # text outside calls not handed out yet: a possible start of <tool_call>
        self._call: Optional[_Call] = None  # the call being read

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._call is None:
                before, after, found = until_tag(self._outside + text, CALL_OPEN, final)
                self._content(out, before)
                if not found:
                    self._outside = after
                    return out
                self._outside, text = "", after
                self._call = _Call(self.num_calls, self._names)
            call = self._call
            deltas, after = call.feed(text, final)
            if after is None:
                if final and not call.named:  # cut before its name: the text it was
                    self._content(out, CALL_OPEN + call.body())
                    self._call = None
                else:
                    out += deltas  # a call cut short (max_tokens) keeps what it streamed
                return out
            if deltas or call.named:
                out += deltas
                out.append(CallEnd(call.index))
                self.num_calls += 1
                self._after_call = True
            else:
                self._content(out, CALL_OPEN + call.body() + CALL_CLOSE)  # not a call after all
            self._call, text = None, after



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
