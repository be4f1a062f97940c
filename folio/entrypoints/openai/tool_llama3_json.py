"""Llama 3's JSON tool calls (vLLM's `--tool-call-parser llama3_json`): the grammar that makes a model write them, and
the reader that reads them back.

Llama 3.1-3.3 Instruct call a function by answering with its JSON object alone, parameters under "parameters":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

and several calls with ";" between them. An answer whose first character is "{" is read as calls; any other is
text. By tool_choice, the grammar (llguidance's Lark dialect, as tool_grammar's) allows:
  * "required": calls only (one, or several with parallel_tool_calls), their parameters following each function's
    schema;
  * a named function: one call of it;
  * "auto": calls, or text that does not start with "{"; with a JSON format for the message, that message or calls.
Each call is a JSON document of its own schema (name constant, parameters the function's), so a message in the
JSON format and a call share their first characters without the grammar choosing early.
"""

from __future__ import annotations

import re
from typing import Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_grammar import (ToolChoice, arguments_schema, call_alternatives, chosen_tools,
                                                   grammar_json, grammar_literal)
from folio.entrypoints.openai.tool_parser import (JSON_SPACE, BracketEnd, CallEnd, Piece, ToolCallReader,
                                                  call_opening, json_members, may_name)
from folio.structured_output.params import StructuredOutputsParams

SEPARATOR = "; "
_GAP = re.compile(r"[ \t\r\n]*(;[ \t\r\n]*)?")  # what may come between two calls


def _call_rule(tool: ChatTool) -> str:
    """One call as a JSON document: {"name": the function's, "parameters": its schema's}. The function's $defs move
    to the document's root, where its $refs point."""
    parameters = dict(arguments_schema(tool))
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return grammar_json({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False, **definitions})


def llama3_json_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                           message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's
    contract, in Llama 3's format)."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    lines = ["%llguidance {}", "calls: call" + (f" ({grammar_literal(SEPARATOR)} call)*" if several else "")]
    if tool_choice == "auto" and message_schema is not None:
        lines += ["start: calls | message", f"message: {grammar_json(message_schema)}"]
    elif tool_choice == "auto":
        lines += ["start: calls | TEXT | EMPTY", r"TEXT: /[^{](.|\n)*/", 'EMPTY: ""']
    else:
        lines += ["start: calls"]
    lines += call_alternatives(tools, _call_rule)
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


class Llama3JsonToolCallReader(ToolCallReader):
    """One choice's reader. Its first character decides: "{" makes it calls, each sent whole as soon as its object
    closes; anything else makes it content, streamed as it comes. An object that is not a call of the request's
    functions (names, a "parameters" object, no other key; "arguments" is read for "parameters" too), or text
    between calls other than ";" and whitespace, makes the rest content from there (so does a call cut off by
    the end of the text). Work per piece is the piece's length: the braces and strings of the object being read
    are followed as they come, and the object is parsed once, when it closes."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._mode: Optional[str] = None  # "calls" or "content", once the first character came
        self._gap = ""  # text since the last call, before the next object opens
        self._object: list[str] = []  # the open object's text, in parts
        self._object_end: Optional[BracketEnd] = None  # follows the open object (None: none is open)

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self._mode is None and text:
            self._mode = "calls" if text.startswith("{") else "content"
        while text and self._mode == "calls":
            text = self._read_object(text, out) if self._object_end else self._read_gap(text, out)
        if text and self._mode == "content":
            out.append(text)
        if final and self._mode == "calls":
            self._to_content(out, "".join(self._object) if self._object_end else
                             self._gap.strip(JSON_SPACE + ";"))
        return out

    def _read_gap(self, text: str, out: list[Piece]) -> str:
        """Text before the next object: what is left after the object opens (its "{" included)."""
        start = text.find("{")
        self._gap += text if start == -1 else text[:start]
        gap_ok = _GAP.fullmatch(self._gap) is not None and (self.num_calls == 0 or start == -1 or ";" in self._gap)
        if not gap_ok:
            self._to_content(out, self._gap.lstrip(JSON_SPACE) + (text[start:] if start != -1 else ""))
            return ""
        if start == -1:
            return ""
        self._gap, self._object, self._object_end = "", [], BracketEnd()
        return self._read_object(text[start:], out)

    def _read_object(self, text: str, out: list[Piece]) -> str:
        """Follow the open object through text: what is left after it closes."""
        end = self._object_end.feed(text)
        self._object.append(text if end == -1 else text[:end])
        if end == -1:
            return ""
        body, self._object, self._object_end = "".join(self._object), [], None
        call = self._call(body)
        if call is None:
            self._to_content(out, body + text[end:])
            return ""
        out += call
        return text[end:]

    def _call(self, body: str) -> Optional[list[Piece]]:
        """A closed object's call pieces (the parameters' text as written), or None where it is not a call of the
        request's functions."""
        call = json_members(body)
        if call is None or set(call) - {"name", "parameters", "arguments"}:
            return None
        parameters = call.get("parameters", call.get("arguments"))
        if parameters is None or not isinstance(parameters[0], dict) or \
                not may_name(self._names, call.get("name", (None,))[0]):
            return None
        index = self.num_calls
        self.num_calls += 1
        return [call_opening(index, call["name"][0], parameters[1]), CallEnd(index)]

    def _to_content(self, out: list[Piece], text: str) -> None:
        """The rest of the choice is content, starting with text."""
        self._mode, self._object, self._object_end, self._gap = "content", [], None, ""
        if text:
            out.append(text)
