"""ToolCallFormat: how a model family writes tool calls (`folio serve --tool-call-parser`, vLLM's flag and names):
the grammar that makes the model write them as tool_choice asks, and the reader that finds them in its text.
Chat completions and the Responses API take both from the server's format; a new format is one module that
provides the two, and one entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_grammar import ToolChoice, hermes_constraint
from folio.entrypoints.openai.tool_llama3_json import Llama3JsonToolCallReader, llama3_json_constraint
from folio.entrypoints.openai.tool_parser import HermesToolCallReader, ToolCallReader
from folio.structured_output.params import StructuredOutputsParams

# (tools, tool_choice resolved, parallel_tool_calls, the JSON a message must be with "auto") -> the grammar
ConstraintBuilder = Callable[[list[ChatTool], ToolChoice, bool, Optional[dict]], Optional[StructuredOutputsParams]]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    constraint: ConstraintBuilder
    reader: Callable[[Optional[Collection[str]]], ToolCallReader]  # the names of the request's functions -> a reader


# The names are ServerOptions.tool_call_parser's choices (server_options.TOOL_CALL_PARSERS).
TOOL_CALL_FORMATS = {tool_format.name: tool_format for tool_format in (
    ToolCallFormat("hermes", hermes_constraint, HermesToolCallReader),  # Qwen2.5, Qwen3, Hermes: <tool_call> blocks
    ToolCallFormat("llama3_json", llama3_json_constraint, Llama3JsonToolCallReader),  # Llama 3.1-3.3: JSON objects
)}
