"""The one constraint on the output of a chat-shaped request (chat completions and responses): a client's own
(vLLM's structured_outputs, or a JSON format: chat's response_format, the Responses API's text.format), or the
grammar tool_choice imposes on tool calls (folio.entrypoints.openai.tool_grammar). Each is validated before the
request is queued; ValueError naming the field."""

from __future__ import annotations

from typing import Any, Optional

from folio.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from folio.entrypoints.openai.tool_grammar import ToolChoice, tool_choice_constraint
from folio.structured_output.manager import StructuredOutputManager
from folio.structured_output.params import StructuredOutputsParams


def json_format(schema: Optional[dict[str, Any]]) -> StructuredOutputsParams:
    """A JSON output format: the schema's documents, or any JSON object where no schema is given."""
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)


def output_constraint(manager: StructuredOutputManager, given: list[tuple[str, StructuredOutputsParams]],
                      tools: Optional[list[ChatTool]], tool_choice: ToolChoice, parallel_tool_calls: bool,
                      parameters_field: str) -> Optional[StructuredOutputsParams]:
    """At most one of the client's constraints (`given`: (field, validated constraint)), or the grammar of
    tool_choice (resolved: tool_grammar.resolve_tool_choice). With "auto", a client's constraint replaces the
    tools' grammar, and calls are still read from the output; a tool_choice that makes the output tool calls
    cannot be combined with one. parameters_field: where tool i's schema is, with {} for i."""
    if len(given) > 1:
        raise ValueError(f"{given[0][0]} and {given[1][0]} both constrain the output: give one of them")
    if tool_choice == "none":
        return given[0][1] if given else None
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            manager.validate(StructuredOutputsParams(json=tool.function.parameters), parameters_field.format(i))
    if given:
        if tool_choice != "auto":
            raise ValueError(f"tool_choice {'named' if isinstance(tool_choice, NamedToolChoice) else tool_choice!r}"
                             f" makes the output tool calls; it cannot be combined with {given[0][0]}")
        return given[0][1]
    constraint = tool_choice_constraint(tools, tool_choice, parallel_tool_calls)
    manager.validate(constraint, "tools")
    return constraint
