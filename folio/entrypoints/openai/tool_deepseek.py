"""DeepSeek's tool calls (vLLM's `--tool-call-parser deepseek_v3` and `deepseek_v31`): the grammar that makes a model
write them, and the reader that reads them back.

DeepSeek V3 and R1 write their calls between marker tokens, as their chat templates render the history's calls:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the call's type, the name on a line of its own, the arguments in a fenced JSON block; a newline between calls);
DeepSeek V3.1 drops the type and the fence, and writes nothing between calls:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers' bars are U+FF5C (full width) and their spaces U+2581, as in DeepSeek's vocabulary: `marker` writes
them by code point. Each is one token of DeepSeek's vocabulary, which a tokenizer may mark special (decoding would
then leave it out of the text), so the format keeps special tokens in the text of the requests whose calls it reads,
and its grammars write the markers by id (`<[id]>` in llguidance's Lark), as the model does: DeepSeekTokens reads
the ids at the server's start. By tool_choice the grammar allows:
  * "required": calls only (one, or several with parallel_tool_calls), arguments following each function's schema;
  * a named function: one call of it;
  * "auto": free text, or free text then calls; with a JSON format for the message, that message or calls. Free
    text cannot hold a marker's token (llguidance's text lexemes never match an added token), nor the opening
    marker's text spelled in other tokens, which the reader would take for calls that no schema constrained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool, DeltaFunctionCall, DeltaToolCall
from folio.entrypoints.openai.tool_grammar import (ToolChoice, arguments_schema, call_alternatives, chosen_tools,
                                                   grammar_json, grammar_literal, marked_calls_start)
from folio.entrypoints.openai.tool_parser import (JSON_SPACE, CallEnd, Piece, ToolCallReader, call_opening,
                                                  json_members, may_name, pending_prefix)
from folio.structured_output.params import StructuredOutputsParams
from folio.tokenizer import Tokenizer


def marker(words: str) -> str:
    """One of DeepSeek's marker tokens: its words between full-width bars, joined by U+2581 (SentencePiece's
    space)."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


CALLS_BEGIN, CALLS_END = marker("tool calls begin"), marker("tool calls end")
CALL_BEGIN, CALL_END, SEP = marker("tool call begin"), marker("tool call end"), marker("tool sep")
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
FENCE_OPEN, FENCE_CLOSE = "```json", "```"  # (V3) around the arguments, each on a line of its own
HEAD_LIMIT = 256  # characters of a call's type or name read before the call is taken as not one


@dataclass(frozen=True)
class DeepSeekTokens:
    """What the grammars need of the model's tokenizer: the markers' ids."""

    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "DeepSeekTokens":
        """ValueError where a marker is not one token of the vocabulary (not a DeepSeek tokenizer)."""
        ids = [tokenizer.backend.token_to_id(m) for m in MARKERS]
        if None in ids:
            raise ValueError("tool_call_parser 'deepseek_v3'/'deepseek_v31' reads calls between DeepSeek's tool-call "
                             f"tokens, and this model's tokenizer lacks {MARKERS[ids.index(None)]}")
        return cls(*ids)


def _call_rule(tokens: DeepSeekTokens, fenced: bool) -> Callable[[ChatTool], str]:
    """One call, from its opening marker to its closing one: the V3 form where `fenced`, the V3.1 form otherwise."""
    begin, sep, end = f"<[{tokens.call_begin}]>", f"<[{tokens.sep}]>", f"<[{tokens.call_end}]>"
    if fenced:
        return lambda tool: (f"{begin} \"function\" {sep} "
                             f"{grammar_literal(tool.function.name + chr(10) + FENCE_OPEN + chr(10))} "
                             f"{grammar_json(arguments_schema(tool))} {grammar_literal(chr(10) + FENCE_CLOSE)} {end}")
    return lambda tool: (f"{begin} {grammar_literal(tool.function.name)} {sep} "
                         f"{grammar_json(arguments_schema(tool))} {end}")


def deepseek_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                        message_schema: Optional[dict] = None, *, tokens: DeepSeekTokens, fenced: bool) \
        -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's contract, in
    DeepSeek V3's form where `fenced`, V3.1's otherwise; ToolCallFormat.resolve gives `tokens`)."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    between = grammar_literal("\n") + " " if fenced else ""
    more = f" ({between}call)*" if several else ""
    lines = [f"calls: <[{tokens.calls_begin}]> call{more} <[{tokens.calls_end}]>",
             *call_alternatives(tools, _call_rule(tokens, fenced))]
    start = marked_calls_start(tool_choice, message_schema, rf"/(.|\n)*/ & ~/(.|\n)*{CALLS_BEGIN}(.|\n)*/")
    return StructuredOutputsParams(grammar="\n".join(["%llguidance {}", *start, *lines]) + "\n")


def _pending_marker(text: str) -> int:
    """Length of the longest end of text that could be the start of a marker."""
    return max(pending_prefix(text, m) for m in MARKERS)


class DeepSeekToolCallReader(ToolCallReader):
    """One choice's reader, of V3's form where `fenced`, of V3.1's otherwise. names: the functions a call may be of
    (None: any).

    Text is content until <｜tool▁calls▁begin｜>; from there to <｜tool▁calls▁end｜>, each <｜tool▁call▁begin｜>
    opens a call. A call streams: its opening delta (id, type, name) once its head (V3: the type, the separator,
    the name and its newline; V3.1: the name and the separator) has come, then its arguments' text as the model
    writes it, as it comes (V3's fence left out); the next marker ends it (<｜tool▁call▁end｜> normally), as the end
    of the text does a call whose arguments are a whole JSON object (one cut off by max_tokens has no end). A head
    that is not one of the request's functions (another marker inside, longer than HEAD_LIMIT, an unknown name) is
    read as content. The markers themselves are never content: they are special tokens of DeepSeek's tokenizer, in
    the text only to read the calls. Whitespace after a call is dropped. Work per piece is the piece's length: only a
    marker's unfinished start, a head, and the arguments' trailing whitespace and fence are held back."""

    def __init__(self, names: Optional[Collection[str]] = None, fenced: bool = False) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._fenced = fenced
        self._closers = JSON_SPACE + ("`" if fenced else "")  # what may end the arguments, held back until they end
        self._state = "outside"  # outside, head, fence, arguments
        self._in_calls = False  # after <｜tool▁calls▁begin｜>, before <｜tool▁calls▁end｜>
        self._held = ""  # text not consumed yet
        self._index = 0  # the open call's
        self._sent: list[str] = []  # its arguments' text so far

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        self._held += text
        step = {"outside": self._outside, "head": self._head, "fence": self._fence, "arguments": self._arguments}
        while step[self._state](out, final):
            pass
        return out

    # Each step consumes what it can of self._held and says whether to go on (False: it needs more text).

    def _outside(self, out: list[Piece], final: bool) -> bool:
        """Content up to the next marker, which opens a call (inside the calls' markers), opens or closes the calls,
        or is dropped."""
        found = _MARKER.search(self._held)
        if found is None:
            keep = 0 if final else _pending_marker(self._held)
            self._content(out, self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return False
        self._content(out, self._held[:found.start()])
        self._held = self._held[found.end():]
        if found.group() == CALL_BEGIN and self._in_calls:
            self._state = "head"
        elif found.group() in (CALLS_BEGIN, CALLS_END):
            self._in_calls = found.group() == CALLS_BEGIN
        return True

    def _head(self, out: list[Piece], final: bool) -> bool:
        """After <｜tool▁call▁begin｜>: the call's head, the name one of the request's functions; otherwise the head is
        read again as text (its markers dropped)."""
        name, end, broken = self._field(0, SEP, final)
        if self._fenced and name is not None:  # that was the type: the name's line follows
            name, end, broken = self._field(end, "\n", final)
        if name is None and not broken:
            return False
        if name is None or not may_name(self._names, name):
            self._state = "outside"
            return True
        self._index, self._sent = self.num_calls, []
        out.append(call_opening(self._index, name))
        self._held, self._state = self._held[end:], "fence" if self._fenced else "arguments"
        return True

    def _field(self, start: int, end: str, final: bool) -> tuple[Optional[str], int, bool]:
        """The held text from `start` up to `end`, where no marker comes before and it is within HEAD_LIMIT: (that
        text, the index past `end`, False); otherwise (None, 0, whether it can no longer come)."""
        at = self._held.find(end, start)
        if _MARKER.search(self._held, start, len(self._held) if at == -1 else at) is not None:
            return None, 0, True
        if at == -1:
            return None, 0, final or len(self._held) - start > HEAD_LIMIT
        if at - start > HEAD_LIMIT:
            return None, 0, True
        return self._held[start:at], at + len(end), False

    def _fence(self, out: list[Piece], final: bool) -> bool:
        """(V3) The arguments' opening fence, read past where it comes."""
        self._held = self._held.lstrip(JSON_SPACE)
        if len(self._held) < len(FENCE_OPEN) and FENCE_OPEN.startswith(self._held) and not final:
            return False
        self._held, self._state = self._held.removeprefix(FENCE_OPEN), "arguments"
        return True

    def _arguments(self, out: list[Piece], final: bool) -> bool:
        """The arguments, as they come, up to the next marker; what may end them (whitespace, V3's closing fence, a
        marker's start) held back until they go on or end."""
        found = _MARKER.search(self._held)
        if found is None and not final:
            body = self._held[:len(self._held) - _pending_marker(self._held)].rstrip(self._closers)
            self._send(out, body)
            self._held = self._held[len(body):]
            return False
        self._send(out, (self._held if found is None else self._held[:found.start()]).rstrip(self._closers))
        ended = found is not None or json_members("".join(self._sent)) is not None
        self._held = "" if found is None else self._held[found.end() if found.group() == CALL_END else found.start():]
        if ended:
            out.append(CallEnd(self._index))
        self.num_calls += 1
        self._state, self._after_call = "outside", True
        return True

    def _send(self, out: list[Piece], text: str) -> None:
        """A piece of the open call's arguments (without their leading whitespace)."""
        if not self._sent:
            text = text.lstrip(JSON_SPACE)
        if text:
            self._sent.append(text)
            out.append(DeltaToolCall(index=self._index, function=DeltaFunctionCall(arguments=text)))
