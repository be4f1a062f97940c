"""Tool calling's grammars: what tool_choice allows the model to write, enforced token by token.

This module writes the grammars of the Hermes format, the default of folio.entrypoints.openai.tool_call_format,
and holds what every format's grammars share (the tools a tool_choice allows, the `call` rule, a call's arguments'
schema, Lark literals and JSON). Qwen2.5 and Qwen3 (and Hermes, and many fine-tunes) were trained on the format, and
folio.entrypoints.openai.tool_parser reads it back:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with the arguments following the function's `parameters` schema. By tool_choice:
  * "required": one call (more with parallel_tool_calls), of any of the tools, and nothing else;
  * a named function: one call of that function;
  * "auto": free text, but once the model writes "<tool_call>" the call must be well formed (the trigger is a
    lazy lexeme: the text before it is unconstrained), so a call never fails to parse; with a JSON format for the
    message (response_format, text.format), either such a message or calls;
  * "none": no grammar, and the output is not read for calls.
The grammar is in llguidance's Lark dialect (`%json` embeds a JSON schema), the structured_output backend's.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Union

from folio.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from folio.structured_output.llguidance_backend import JSON_OPTIONS
from folio.structured_output.params import StructuredOutputsParams

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# JSON Schema's keywords that describe a value and constrain nothing.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                         "$comment"})

ToolChoice = Union[str, NamedToolChoice]


def grammar_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal with JSON escapes


def grammar_json(schema: dict) -> str:
    """A JSON schema's documents as a grammar rule's body, written as the structured_output backend writes JSON."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def arguments_schema(tool: ChatTool) -> dict:
    """The schema of a call's arguments: the function's parameters, an object. Every format's reader takes only an
    object for arguments (OpenAI's are one), but a schema that does not say "type": "object" takes any JSON value
    (a string, a number), which a grammar would let the model write, and which would then be no call; so the
    type is added where the schema names none, narrowed to "object" where it names several, and a schema whose
    type leaves out objects is refused (ValueError, a 400 naming the tool)."""
    schema = tool.function.parameters or {}
    types = schema.get("type")
    if types == "object":
        return schema
    if types is not None and not (isinstance(types, list) and "object" in types):
        raise ValueError(f"tools: the parameters of {tool.function.name!r} are of type {types!r}, not an object "
                         "(a call's arguments are a JSON object)")
    return {**schema, "type": "object"}


def _call_rule(tool: ChatTool) -> str:
    """One call's text after CALL_OPEN: the name forced, the arguments constrained by the tool's schema."""
    begin = '\n{"name": ' + json.dumps(tool.function.name) + ', "arguments": '
    end = "}\n" + CALL_CLOSE
    arguments = grammar_json(arguments_schema(tool))
    return f"{grammar_literal(begin)} {arguments} {grammar_literal(end)}"


def chosen_tools(tools: list[ChatTool], tool_choice: ToolChoice,
                 parallel_tool_calls: bool) -> tuple[list[ChatTool], bool]:
    """The tools a call may be of (the named one only, for a named function), and whether several calls may
    come."""
    if isinstance(tool_choice, NamedToolChoice):
        return [t for t in tools if t.function.name == tool_choice.function.name], False
    return tools, parallel_tool_calls


def call_alternatives(tools: list[ChatTool], call_rule: Callable[[ChatTool], str]) -> list[str]:
    """The grammar's `call` rule: a call of any of the tools, each written by call_rule."""
    return ["call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            *(f"call_{i}: {call_rule(tool)}" for i, tool in enumerate(tools))]


def hermes_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                           message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice (see `resolve_tool_choice`), or None for "none". message_schema
    (with "auto" only): the JSON a message must be, instead of free text."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    lines = ["%llguidance {}", *tagged_calls_start(tool_choice, several, message_schema),
             *call_alternatives(tools, _call_rule)]
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


def tagged_calls_start(tool_choice: ToolChoice, several: bool, message_schema: Optional[dict]) -> list[str]:
    """The `start` rules of a format whose calls each open with CALL_OPEN (Hermes, Qwen3-Coder), given the `call`
    rule after it: calls only, or with "auto" free text in which CALL_OPEN triggers a call (a lazy lexeme: the text
    before it is unconstrained), or, with a message schema, such a message or calls."""
    more = f" ({grammar_literal(chr(10) + CALL_OPEN)} call)*" if several else ""
    if tool_choice == "auto" and message_schema is not None:
        return [f"start: message | {grammar_literal(CALL_OPEN)} call{more}", f"message: {grammar_json(message_schema)}"]
    if tool_choice == "auto":
        return [f"start: TEXT | text_then_open call{more}",
                f"text_then_open[lazy]: TEXT {grammar_literal(CALL_OPEN)}", r"TEXT: /(.|\n)*/"]
    return [f"start: {grammar_literal(CALL_OPEN)} call{more}"]


def marked_calls_start(tool_choice: ToolChoice, message_schema: Optional[dict], text: str) -> list[str]:
    """The `start` rules of a format whose `calls` rule opens with a marker token (Mistral's, DeepSeek's): calls only,
    or with "auto" free text (the TEXT regex given, which may keep the marker's spelling out) and then calls, or, with
    a message schema, such a message or calls."""
    if tool_choice == "auto" and message_schema is not None:
        return ["start: message | calls", f"message: {grammar_json(message_schema)}"]
    if tool_choice == "auto":
        return ["start: TEXT | TEXT calls", f"TEXT: {text}"]
    return ["start: calls"]


def resolve_tool_choice(tools: Optional[list[ChatTool]], tool_choice: Optional[ToolChoice],
                        auto_allowed: bool = True) -> ToolChoice:
    """OpenAI's default ("auto" with tools, "none" without: "auto" without tools is "none" too), checked against
    the tools and against the server (`auto_allowed`: folio serve --no-enable-auto-tool-choice refuses "auto");
    ValueError naming the field otherwise."""
    names = [t.function.name for t in tools or ()]
    if len(set(names)) < len(names):
        raise ValueError(f"tools must have distinct function names, got {', '.join(names)}")
    if tool_choice is None or (tool_choice == "auto" and not tools):
        tool_choice = "auto" if tools else "none"
    if tool_choice == "auto" and not auto_allowed:
        raise ValueError('tool_choice "auto" (the default beside tools) is off on this server (it runs without '
                         '--enable-auto-tool-choice): ask for "required", a named function or "none"')
    if tool_choice in ("auto", "none"):
        return tool_choice
    if not tools and tool_choice != "none":
        raise ValueError("tool_choice requires tools")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {tool_choice.function.name!r}, which is not among "
                             f"the tools ({', '.join(names)})")
    return tool_choice
