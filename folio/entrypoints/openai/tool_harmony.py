"""GPT-OSS's tool calls (vLLM's `--tool-call-parser openai`): harmony messages to a function (folio.harmony).

A call is a commentary message whose recipient is `functions.NAME`, its text the arguments' JSON:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may come before the channel too). `<|call|>` ends generation, so a turn makes one call. Harmony is
the structure of the whole output, not only of its calls, so the format reads every chat-shaped output of its
server (ToolCallFormat.whole_output; under tool_choice "none" no function may be called): the text of final and
preamble (commentary without a recipient) messages is content, a call's text streams as its arguments as it
comes, as the model writes it; a message to anything else than one of the request's functions, and text in no
message, is content too; analysis messages are content where no reasoning parser took them out (as any reasoning
is without one). The markers never reach the content. A call the output ends in, cut off before its arguments are
whole JSON (max_tokens), has no end: the Responses API gives it as incomplete.

The grammars write the markers by id (`<[id]>` in llguidance's Lark) and let the model think first: any number of
analysis messages (free text, which cannot hold a special token), then by tool_choice
  * "required": one call of any of the functions, its arguments following the function's schema;
  * a named function: one call of it;
  * "auto": preambles among the analysis, then a final message of free text or a call (with a JSON format for
    the message: a final message in that format, or a call);
  * "none" with a JSON format: a final message in that format.
A call ends where its JSON does: any end-of-sequence id may follow (the model's is `<|call|>`, a final message's
`<|return|>`).
"""

from __future__ import annotations

from typing import Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool, DeltaFunctionCall, DeltaToolCall
from folio.entrypoints.openai.tool_grammar import (ToolChoice, arguments_schema, call_alternatives, chosen_tools,
                                                   grammar_json, grammar_literal)
from folio.entrypoints.openai.tool_parser import CallEnd, Piece, ToolCallReader, call_opening, may_name, read_json
from folio.harmony import CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, START, Body, Closed, HarmonyReader, Header, \
    Stray
from folio.harmony_split import HarmonyTokens
from folio.structured_output.params import StructuredOutputsParams


def _call_rule(tokens: HarmonyTokens):
    """One call: its header naming the function, then the arguments."""
    return lambda tool: (f"<[{tokens[CHANNEL]}]> {grammar_literal(f'commentary to={FUNCTIONS}{tool.function.name} ')} "
                         f"<[{tokens[CONSTRAIN]}]> \"json\" <[{tokens[MESSAGE]}]> "
                         f"{grammar_json(arguments_schema(tool))}")


def harmony_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                       message_schema: Optional[dict] = None, *, tokens: HarmonyTokens) \
        -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice (tool_grammar.hermes_constraint's contract), or None for "none"
    without a message schema; ToolCallFormat.resolve gives `tokens`. parallel_tool_calls changes nothing: a call
    ends the turn."""
    if tool_choice == "none" and message_schema is None:
        return None
    channel, message = f"<[{tokens[CHANNEL]}]>", f"<[{tokens[MESSAGE]}]>"
    lines = [f"next: <[{tokens[START]}]> \"assistant\"",
             f"analysis: {channel} \"analysis\" {message} TEXT <[{tokens[END]}]>", r"TEXT: /(.|\n)*/"]
    final = f'{channel} "final" {message}'
    if message_schema is not None:
        lines.append(f"final: {final} {grammar_json(message_schema)}")
    elif tool_choice == "auto":
        lines.append(f"final: {final} TEXT")
    if tool_choice == "auto":
        lines += ["start: (note next)* (final | call)", "note: analysis | preamble",
                  f"preamble: {channel} \"commentary\" {message} TEXT <[{tokens[END]}]>"]
    else:
        lines.append("start: (analysis next)* " + ("final" if tool_choice == "none" else "call"))
    if tool_choice != "none":
        lines += call_alternatives(chosen_tools(tools, tool_choice, parallel_tool_calls)[0], _call_rule(tokens))
    return StructuredOutputsParams(grammar="\n".join(["%llguidance {}", *lines]) + "\n")


class HarmonyToolCallReader(ToolCallReader):
    """One choice's reader. names: the functions a call may be of (none under tool_choice "none")."""

    def __init__(self, names: Collection[str]) -> None:
        super().__init__()
        self._names = frozenset(names)
        self._reader = HarmonyReader()
        self._call: Optional[int] = None  # the index of the call whose message is open
        self._arguments: list[str] = []  # its arguments' text so far

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        for event in self._reader.feed(text, final):
            if isinstance(event, Header):
                name = event.function()
                if name is not None and may_name(self._names, name):
                    self._call, self._arguments = self.num_calls, []
                    self.num_calls += 1
                    out.append(call_opening(self._call, name))
            elif isinstance(event, Body) and self._call is not None:
                self._arguments.append(event.text)
                out.append(DeltaToolCall(index=self._call, function=DeltaFunctionCall(arguments=event.text)))
            elif isinstance(event, (Body, Stray)):
                self._content(out, event.text)
            elif isinstance(event, Closed) and self._call is not None:
                if event.marker is not None or _whole_json("".join(self._arguments)):
                    out.append(CallEnd(self._call))
                self._call, self._after_call = None, True
        return out


def _whole_json(text: str) -> bool:
    """Whether the arguments of a call the text ended in are whole JSON. `<|call|>`, which ends generation, is
    left out of the text, so such a call is taken as ended, as a Hermes call stopped before `</tool_call>` with
    its object whole is (tool_parser._Call); one cut off inside them (max_tokens) has no end, and is incomplete."""
    try:
        read_json(text)
    except ValueError:
        return False
    return True
