"""Llama 3's JSON tool calls (vLLM's `--tool-call-parser llama3_json`): the grammar that makes a model write them, and
the parser that reads them back.

Llama 3.1-3.3 Instruct call a function by answering with its JSON object alone, parameters under "parameters":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

and several calls with "; " between them. An answer that starts with "{" is calls; any other is text. By
tool_choice, the grammar (llguidance's Lark dialect, as tool_grammar's) allows:
  * "required": calls only (one, or several with parallel_tool_calls), their parameters following each function's
    schema;
  * a named function: one call of it;
  * "auto": calls, or text that does not start with "{"; with a JSON format for the message, that message or calls.
"""

from __future__ import annotations

import json
import uuid
from typing import Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool, DeltaFunctionCall, DeltaToolCall, NamedToolChoice
from folio.entrypoints.openai.tool_grammar import ANY_ARGUMENTS, ToolChoice, grammar_json, grammar_literal
from folio.entrypoints.openai.tool_parser import CallEnd, Piece, ToolCallReader, is_text
from folio.structured_output.params import StructuredOutputsParams

SEPARATOR = "; "


def _call_rule(tool: ChatTool) -> str:
    begin = '{"name": ' + json.dumps(tool.function.name) + ', "parameters": '
    parameters = grammar_json(tool.function.parameters or ANY_ARGUMENTS)
    return f"{grammar_literal(begin)} {parameters} {grammar_literal('}')}"


def llama3_json_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                           message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.tool_choice_constraint's
    contract, in Llama 3's format)."""
    if tool_choice == "none":
        return None
    named = isinstance(tool_choice, NamedToolChoice)
    if named:
        tools = [t for t in tools if t.function.name == tool_choice.function.name]
    more = f" ({grammar_literal(SEPARATOR)} call)*" if parallel_tool_calls and not named else ""
    lines = ["%llguidance {}", f"calls: call{more}"]
    if tool_choice == "auto" and message_schema is not None:
        lines += ["start: calls | message", f"message: {grammar_json(message_schema)}"]
    elif tool_choice == "auto":
        lines += ["start: calls | TEXT | EMPTY", r"TEXT: /[^{](.|\n)*/", 'EMPTY: ""']
    else:
        lines += ["start: calls"]
    lines += ["call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
              *(f"call_{i}: {_call_rule(tool)}" for i, tool in enumerate(tools))]
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


class Llama3JsonToolParser(ToolCallReader):
    """One choice's parser. The choice's first characters decide: "{" (after any whitespace) makes it calls, held
    back and sent whole, each as soon as its object is complete; anything else makes it content, streamed as it
    comes. A call object that does not parse, names no function of the request's tools or has no parameters
    object is content, from there to the end (so is a call cut off by the end of the text)."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._text = ""  # the choice's text while it may be calls
        self._read = 0  # characters of it read as calls
        self._mode: Optional[str] = None  # "calls" or "content", once known
        self._decoder = json.JSONDecoder()

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        if self._mode == "content":
            return [text] if text else []
        self._text += text
        if self._mode is None:
            start = self._text.lstrip()
            if not start and not final:
                return []
            self._mode = "calls" if start.startswith("{") else "content"
            if self._mode == "content":
                return [self._text] if self._text else []
        out: list[Piece] = []
        while "}" in text or final:
            call = self._next_call()
            if call is None:
                break
            out += call
        if final and self._read < len(self._text):  # what did not make a call: content
            rest = self._text[self._read:].strip() if self.num_calls else self._text
            self._read = len(self._text)
            if rest:
                out.append(rest)
        return out

    def _next_call(self) -> Optional[list[Piece]]:
        """The next whole call's pieces, or None when none is complete yet (or what follows is not a call: then the
        text's end makes it content)."""
        at = len(self._text) - len(self._text[self._read:].lstrip())
        if self.num_calls:
            if not self._text.startswith(SEPARATOR.strip(), at):
                return None
            at = len(self._text) - len(self._text[at + 1:].lstrip())
        try:
            call, end = self._decoder.raw_decode(self._text, at)
        except (ValueError, RecursionError):  # incomplete, or not JSON
            return None
        if not isinstance(call, dict) or not self._may_name(call.get("name")):
            return None
        parameters = call.get("parameters", call.get("arguments"))
        if not isinstance(parameters, dict) or set(call) - {"name", "parameters", "arguments"}:
            return None
        self._read = end
        index = self.num_calls
        self.num_calls += 1
        arguments = json.dumps(parameters, ensure_ascii=False)
        return [DeltaToolCall(index=index, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                              function=DeltaFunctionCall(name=call["name"], arguments=arguments)), CallEnd(index)]

    def _may_name(self, name: object) -> bool:
        return is_text(name) and (self._names is None or name in self._names)
