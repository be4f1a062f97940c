"""Mistral's tool calls (vLLM's `--tool-call-parser mistral`): the grammar that makes a model write them, and the
reader that reads them back.

Mistral models open their calls with the control token [TOOL_CALLS], in one of two forms by tokenizer version:
  * before v11 (Mistral-7B-Instruct-v0.3, Mistral-Nemo, Mistral-Small-24B-2501): a JSON list of calls,
        [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    (Mistral-7B-v0.3, a SentencePiece model, writes a space before the list: the grammar allows one);
  * v11 and later (Mistral-Small-3.2, Magistral, Devstral 2507+: their vocabulary has [ARGS]): one marker a call,
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
    (some versions write [CALL_ID] and an id before [ARGS]).
The markers are special tokens, which decoding leaves out of the text by default, so the format keeps them in the
text of the requests whose calls it reads (ToolCallFormat.keeps_special_tokens, as vLLM's adjust_request), and its
grammars write them by id (`<[id]>` in llguidance's Lark dialect): MistralTokens reads the ids, and which form the
model writes, from its tokenizer at the server's start. The reader reads both forms, whatever the tokenizer. By
tool_choice the grammar allows:
  * "required": calls only (one, or several with parallel_tool_calls), arguments following each function's schema;
  * a named function: one call of it;
  * "auto": free text, or free text then calls (the text before [TOOL_CALLS] is content); with a JSON format for
    the message, that message or calls. Free text cannot hold a special token (llguidance's text lexemes never
    match one), so no other control token reaches the content either.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_grammar import (ToolChoice, arguments_schema, call_alternatives, chosen_tools,
                                                   grammar_json, grammar_literal, marked_calls_start)
from folio.entrypoints.openai.tool_parser import (JSON_SPACE, BracketEnd, CallEnd, Piece, ToolCallReader,
                                                  call_opening, json_members, may_name, pending_prefix)
from folio.structured_output.params import StructuredOutputsParams
from folio.tokenizer import Tokenizer

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MARKERS = (TOOL_CALLS, ARGS, CALL_ID)
_MARKER = re.compile("|".join(re.escape(marker) for marker in _MARKERS))
_ID_CHARS = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(_ID_CHARS + "_-")  # OpenAI's function names: ^[a-zA-Z0-9_-]{1,64}$
_MAX_NAME = 64


@dataclass(frozen=True)
class MistralTokens:
    """What the grammars need of the model's tokenizer: the ids of the markers they write; [ARGS]'s id makes them
    write the v11 form."""

    tool_calls: int
    args: Optional[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "MistralTokens":
        """ValueError where the vocabulary has no [TOOL_CALLS] (not a Mistral tokenizer)."""
        tool_calls = tokenizer.backend.token_to_id(TOOL_CALLS)
        if tool_calls is None:
            raise ValueError(f"tool_call_parser 'mistral' reads calls after the token {TOOL_CALLS}, which this "
                             "model's tokenizer does not have")
        return cls(tool_calls, tokenizer.backend.token_to_id(ARGS))


def mistral_call_id() -> str:
    """A call id as Mistral's chat templates take it back: 9 letters and digits (mistral_common's rule)."""
    return "".join(random.choices(_ID_CHARS, k=9))


def _list_call_rule(tool: ChatTool) -> str:
    """One call of the list form: {"name": the function's, "arguments": its schema's}."""
    begin = '{"name": ' + json.dumps(tool.function.name) + ', "arguments": '
    return f"{grammar_literal(begin)} {grammar_json(arguments_schema(tool))} {grammar_literal('}')}"


def _v11_call_rule(args_id: int) -> Callable[[ChatTool], str]:
    """One call of the v11 form after its [TOOL_CALLS]: the name, [ARGS], the arguments."""
    return lambda tool: (f"{grammar_literal(tool.function.name)} <[{args_id}]> "
                         f"{grammar_json(arguments_schema(tool))}")


def mistral_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                       message_schema: Optional[dict] = None, *, tokens: MistralTokens) \
        -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's contract, in
    the form of the model's tokenizer; ToolCallFormat.resolve gives `tokens`)."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    open_calls = f"<[{tokens.tool_calls}]>"
    if tokens.args is None:  # (a space may follow the marker: Mistral-7B-v0.3, a SentencePiece model, writes "▁[")
        more = f" ({grammar_literal(', ')} call)*" if several else ""
        lines = [f'calls: {open_calls} " "? "[" call{more} "]"', *call_alternatives(tools, _list_call_rule)]
    else:
        more = f" ({open_calls} call)*" if several else ""
        lines = [f"calls: {open_calls} call{more}", *call_alternatives(tools, _v11_call_rule(tokens.args))]
    start = marked_calls_start(tool_choice, message_schema, r"/(.|\n)*/")
    return StructuredOutputsParams(grammar="\n".join(["%llguidance {}", *start, *lines]) + "\n")


class MistralToolCallReader(ToolCallReader):
    """One choice's reader, for both forms. Text is content until [TOOL_CALLS]; what follows is read as the list
    form where it starts with "[", as the v11 form otherwise, each call sent whole as soon as its object closes
    (with a fresh id of Mistral's shape, and its arguments' text as the model wrote it). Whitespace around calls
    is dropped; text after them is content, and a further [TOOL_CALLS] opens calls again. Where what follows the
    marker stops being a call of the request's functions (a character the form does not allow there, an object
    that is not a call, the end of the text: a call cut by max_tokens), the text from the marker (or from the
    last call in a list) up to there is content, and reading goes on from there as text. The markers themselves
    are never content: they are special tokens, in the text only because the format keeps those (vLLM's reader
    drops them too). Work per piece is the piece's length: objects are followed as they come and parsed once,
    when they close."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._mode = "text"  # text, then after [TOOL_CALLS]: open, then list (list form) or name, id, args (v11)
        self._list = False  # the calls being read are the list form
        self._held = ""  # the end of the last piece, which may be the start of a marker
        self._raw: list[str] = []  # the text of the calls being read, not yet handed out: content if they fail
        self._item_done = False  # (list form) a call came since "[" or the last ","
        self._name = ""  # (v11 form) the call's name
        self._object: Optional[BracketEnd] = None  # the call's object being followed (the v11 form's arguments)
        self._object_parts: list[str] = []  # its text so far

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        text, self._held = self._held + text, ""
        while True:
            if self._mode == "text":
                text = self._read_text(text, final, out)
            elif text:
                text = self._step(text, out)
            elif final:  # the text ended inside the calls: what is left of them is content
                text, self._held = self._fail(out, self._held), ""
            if not text and (self._mode == "text" or not final):
                return out

    def _read_text(self, text: str, final: bool, out: list[Piece]) -> str:
        """Content up to the next [TOOL_CALLS], without the other markers (a trailing start of one held back): what
        follows it."""
        start = text.find(TOOL_CALLS)
        if start == -1:
            keep = 0 if final else max(pending_prefix(text, marker) for marker in _MARKERS)
            self._content(out, _MARKER.sub("", text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            return ""
        self._content(out, _MARKER.sub("", text[:start]))
        self._mode, self._raw = "open", [TOOL_CALLS]
        return text[start + len(TOOL_CALLS):]

    def _step(self, text: str, out: list[Piece]) -> str:
        """Read on in the calls: what is left of text for the next step."""
        if self._object is not None:
            return self._read_object(text, out)
        if self._mode in ("name", "id"):
            return self._read_name(text, out)
        stripped = text.lstrip(JSON_SPACE)
        self._raw.append(text[:len(text) - len(stripped)])
        if not stripped:
            return ""
        char = stripped[0]
        if self._mode == "open":
            self._list = char == "["
            self._mode = "list" if self._list else "name"
            if not self._list:
                return stripped
        elif char not in ("{" if self._mode == "args" or not self._item_done else ",]"):
            return self._fail(out, stripped)
        elif char == "{":
            self._object, self._object_parts = BracketEnd(), []
            return stripped
        self._raw.append(char)  # "[" opening the list, or "," or "]" after a call in it
        self._item_done = False
        if char == "]":
            self._end_calls()
        return stripped[1:]

    def _read_name(self, text: str, out: list[Piece]) -> str:
        """(v11 form) The function's name, then [CALL_ID] and an id (read past: calls get ids of their own) or
        directly [ARGS]."""
        markers = (ARGS, CALL_ID) if self._mode == "name" else (ARGS,)
        for i, char in enumerate(text):
            if char == "[":
                rest = text[i:]
                marker = next((m for m in markers if rest.startswith(m)), None)
                if marker is None and any(m.startswith(rest) for m in markers):  # cut inside a marker
                    self._raw.append(text[:i])
                    self._held = rest
                    return ""
                named = self._mode == "id" or (self._name and may_name(self._names, self._name))
                if marker is None or not named:
                    break
                self._raw.append(text[:i + len(marker)])
                self._mode = "args" if marker == ARGS else "id"
                return rest[len(marker):]
            if self._mode == "id":
                if char not in _ID_CHARS:
                    break
            elif char in _NAME_CHARS and len(self._name) < _MAX_NAME:
                self._name += char
            else:
                break
        else:
            self._raw.append(text)
            return ""
        self._raw.append(text[:i])
        return self._fail(out, text[i:])

    def _read_object(self, text: str, out: list[Piece]) -> str:
        """Follow the call's object to its end, then read it: a call of the list form, or the v11 form's
        arguments."""
        end = self._object.feed(text)
        self._object_parts.append(text if end == -1 else text[:end])
        if end == -1:
            return ""
        body = "".join(self._object_parts)
        self._object, self._object_parts = None, []
        members = json_members(body)
        call = _list_call(members, self._names) if self._list else \
            ((self._name, body) if members is not None else None)
        if call is None:
            self._raw.append(body)
            return self._fail(out, text[end:])
        index = self.num_calls
        self.num_calls += 1
        out += [call_opening(index, call[0], call[1], mistral_call_id()), CallEnd(index)]
        self._raw, self._after_call = [], True
        if self._list:
            self._item_done = True
        else:
            self._end_calls()
        return text[end:]

    def _fail(self, out: list[Piece], rest: str) -> str:
        """The calls being read are not calls from here on: their text is content (the markers left out), and rest
        is read as text."""
        self._content(out, _MARKER.sub("", "".join(self._raw + self._object_parts)))
        self._mode, self._raw, self._after_call = "text", [], False  # (what follows is not after a call)
        self._item_done, self._name, self._object, self._object_parts = False, "", None, []
        return rest

    def _end_calls(self) -> None:
        self._mode, self._raw, self._name = "text", [], ""


def _list_call(members: Optional[dict[str, tuple[object, str]]], names: Optional[frozenset[str]]) \
        -> Optional[tuple[str, str]]:
    """An object of the list form (its members, json_members') as (name, arguments' text as written), where it is
    a call of the request's functions: a name, an arguments object, and perhaps the id Mistral's own prompts give
    calls (read past)."""
    if members is None or set(members) - {"name", "arguments", "id"}:
        return None
    name, arguments = members.get("name", (None, "")), members.get("arguments", (None, ""))
    if not isinstance(arguments[0], dict) or not may_name(names, name[0]):
        return None
    return name[0], arguments[1]
