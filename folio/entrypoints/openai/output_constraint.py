"""The one constraint on the output of a chat-shaped request (chat completions and responses): vLLM's
structured_outputs, a JSON format for the message (chat's response_format, the Responses API's text.format), the
grammar tool_choice imposes on tool calls (in the server's tool-call format, tool_call_format), or the last two
together.
Each is validated before the request is queued; ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from folio.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from folio.entrypoints.openai.tool_call_format import ToolCallFormat
from folio.entrypoints.openai.tool_grammar import ToolChoice
from folio.structured_output.manager import StructuredOutputManager
from folio.structured_output.params import StructuredOutputsParams


@dataclass(frozen=True)
class MessageFormat:
    """The JSON a message of the output must be: a schema's documents, or any JSON object (schema None)."""

    field: str  # the request's field, for errors
    schema_field: str  # where in it the schema is
    schema: Optional[dict[str, Any]]

    def constraint(self) -> StructuredOutputsParams:
        """The format alone, for an output that is only the message."""
        if self.schema is None:
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=self.schema)


def output_constraint(manager: StructuredOutputManager, tool_format: ToolCallFormat, tools: Optional[list[ChatTool]],
                      tool_choice: ToolChoice, parallel_tool_calls: bool, parameters_field: str,
                      structured_outputs: Optional[StructuredOutputsParams] = None,
                      message_format: Optional[MessageFormat] = None,
                      structured_outputs_field: Optional[str] = None) -> Optional[StructuredOutputsParams]:
    """The constraint for a resolved tool_choice (tool_grammar.resolve_tool_choice), tool calls written in the
    server's tool_format. parameters_field: where tool i's schema is, with {} for i; structured_outputs_field: the
    field structured_outputs came in, where it was not structured_outputs (vLLM's guided_*).

    A message format applies to the text the model writes, as OpenAI's does: with "auto" the output is either a
    message in the format or tool calls; with "required" or a named function the output is calls, and the format
    waits for a later turn's message. vLLM's structured_outputs constrains the whole output: with "auto" it
    replaces the tools' grammar (calls are still read from the output); a tool_choice that makes the output tool
    calls cannot be combined with it. A format that is the whole output's structure (harmony) frames the message
    format itself, under "none" too, and refuses structured_outputs, which would constrain its markers."""
    named = structured_outputs_field or "structured_outputs"
    if structured_outputs is not None:
        manager.validate(structured_outputs, structured_outputs_field)
    if message_format is not None:
        manager.validate(message_format.constraint(), message_format.schema_field)
        if structured_outputs is not None:
            raise ValueError(f"{named} and {message_format.field} both constrain the output: give one of them")
    for i, tool in enumerate(tools or ()):  # (under "none" too: the template shows them to the model)
        if tool.function.parameters is not None:
            manager.validate(StructuredOutputsParams(json=tool.function.parameters), parameters_field.format(i))
    if structured_outputs is not None and tool_format.whole_output:
        raise ValueError(f"{named} constrains the whole output, which this model writes as harmony messages: give "
                         f"the JSON the answer must be as {message_format.field if message_format else 'its format'}"
                         " (chat's response_format, the Responses API's text.format)")
    if tool_choice == "none" and not (tool_format.whole_output and message_format is not None):
        return structured_outputs or (message_format.constraint() if message_format is not None else None)
    if structured_outputs is not None:
        if tool_choice != "auto":
            raise ValueError(f"tool_choice {'named' if isinstance(tool_choice, NamedToolChoice) else tool_choice!r}"
                             f" makes the output tool calls; it cannot be combined with {named}")
        return structured_outputs
    message_schema = None
    if message_format is not None and tool_choice in ("auto", "none"):
        message_schema = message_format.schema if message_format.schema is not None else {"type": "object"}
    constraint = tool_format.constraint(tools, tool_choice, parallel_tool_calls, message_schema)
    manager.validate(constraint, "tools")
    return constraint
