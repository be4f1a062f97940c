"""GLM-4.5's tool calls (vLLM's `--tool-call-parser glm45`, for GLM-4.5 and GLM-4.6): the grammar that makes a model
write them, and the reader that reads them back by the functions' schemas.

GLM-4.5 writes each call as a block of key and value tags, several calls as several blocks, as its chat template
renders the history's calls:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A string's value is its raw text (no quotes, no escapes) and any other value its JSON text: the template's
`v | tojson if v is not string else v`, Qwen3-Coder's rule. So a value is read, and its grammar written, by its
parameter's schema exactly as folio.entrypoints.openai.tool_qwen3_coder does (ValueForm, Signature: the same
parameters in the same order, of the same forms), with this format's tags around it: a raw string's text ends at the
first "</arg_value>", which it cannot hold. vLLM's reader types a value by its schema's "type" alone and reads a
non-string through JSON or else a Python literal; the forms here also read an Optional[str]'s "null" as None, a
string enum's text raw, and a non-JSON value as the string it is. Names are read with whitespace around them
stripped (as vLLM's reader does), so a parameter named with whitespace at either end cannot be written; nor can
one Qwen3-Coder's format cannot name (a ">" in it), nor a schema keyword on the object as a whole (anyOf,
minProperties, ...): a tool that needs one is a 400 naming it, as is a string enum whose text holds "</arg_value>".
GLM-4.7's variant, without the newlines, reads the same.

By tool_choice, the grammar (llguidance's Lark dialect, as tool_grammar's) allows:
  * "required": calls only (one, or several with parallel_tool_calls, a newline between them);
  * a named function: one call of it;
  * "auto": free text, but once the model writes "<tool_call>" the call must be well formed (the Hermes grammar's
    lazy trigger); with a JSON format for the message, that message or calls.
GLM-4.5 thinks in <think>...</think> first: `--reasoning-parser glm45` (folio.reasoning_parser) takes it out, and the
grammars start after it.
"""

from __future__ import annotations

from typing import Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_grammar import (ANNOTATIONS, CALL_CLOSE, CALL_OPEN, ToolChoice, arguments_schema,
                                                   grammar_json, grammar_literal)
from folio.entrypoints.openai.tool_parser import JSON_SPACE, Piece, may_name
from folio.entrypoints.openai.tool_qwen3_coder import (NAME_LIMIT, Qwen3CoderToolCallReader, Signature, ValueForm,
                                                       tagged_values_constraint)
from folio.structured_output.params import StructuredOutputsParams

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
# The schema keywords a function's parameters may have besides its parameters' own: those Signature.of reads.
_PER_PARAMETER = ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                                "$schema"}


def _signature(tool: ChatTool) -> Signature:
    """The parameters the grammar writes for a tool (Qwen3-Coder's, but for names with whitespace at either end);
    ValueError where the format cannot write every call the schema takes."""
    schema = arguments_schema(tool)
    signature = Signature.of(tool, strict=False)
    parameters = tuple(p for p in signature.parameters if p.name == p.name.strip(JSON_SPACE))
    written = {p.name for p in parameters}
    beyond = sorted(set(schema) - _PER_PARAMETER)
    missing = [key for key in schema.get("required", ()) if isinstance(key, str) and key not in written]
    forms = [(p.name, p.form) for p in parameters] + [("a further parameter", signature.extra)]
    closing = [name for name, form in forms
               if form is not None and any(VALUE_CLOSE in choice for choice in form.choices or ())]
    problem = (f"its parameters' schema has {', '.join(beyond)}" if beyond else
               f"its required parameter {missing[0]!r} cannot be written" if missing else
               f"a value of {closing[0]!r} holds {VALUE_CLOSE}" if closing else None)
    if problem is not None:
        raise ValueError(f"tools: the glm45 format writes a call's arguments one by one, and cannot write every call "
                         f"of {tool.function.name!r}: {problem}")
    return Signature(parameters, signature.extra)


def _value_grammar(form: ValueForm) -> str:
    """A value's grammar, with the end of its argument ("</arg_value>\\n")."""
    end = VALUE_CLOSE + "\n"
    if form.kind == "json":
        return f"{grammar_json(form.schema)} {grammar_literal(end)}"
    if form.choices is None:
        return f"raw_value {grammar_literal(chr(10))}"
    choices = form.choices + (("null",) if form.nullable else ())
    return "(" + " | ".join(grammar_literal(choice + end) for choice in choices) + ")"


def _call_rule(tool: ChatTool) -> str:
    """One call's text after CALL_OPEN: the name forced, the arguments in the schema's order."""
    signature = _signature(tool)
    key_end = KEY_CLOSE + "\n" + VALUE_OPEN
    parts = [grammar_literal(tool.function.name + "\n")]
    for parameter in signature.parameters:
        written = f"({grammar_literal(KEY_OPEN + parameter.name + key_end)} {_value_grammar(parameter.form)})"
        parts.append(written if parameter.required else written + "?")
    if signature.extra is not None:
        parts.append(f"({grammar_literal(KEY_OPEN)} EXTRA_NAME {grammar_literal(key_end)} "
                     f"{_value_grammar(signature.extra)})*")
    parts.append(grammar_literal(CALL_CLOSE))
    return " ".join(parts)


def glm45_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                     message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's contract, in
    GLM-4.5's format); ValueError naming tools whose schema the format cannot write."""
    return tagged_values_constraint(tools, tool_choice, parallel_tool_calls, message_schema, _call_rule, VALUE_CLOSE)


class Glm45ToolCallReader(Qwen3CoderToolCallReader):
    """One choice's reader, given the request's tools (None: any function, every value a string): Qwen3-Coder's
    reader (how values stream and are typed, what is content, how a broken or cut-off call ends) on GLM-4.5's tags.

    A block is a call once `<tool_call>NAME` is followed by a newline or a tag (GLM-4.7 writes none), the name one of
    the request's functions; then each `<arg_key>KEY</arg_key>`, whitespace, `<arg_value>VALUE</arg_value>` is an
    argument, a value ending at the first "</arg_value>"; `</tool_call>` closes the call."""

    value_end = VALUE_CLOSE

    def _head(self, out: list[Piece], final: bool) -> bool:
        """After <tool_call>: the function's name, up to a newline or a tag."""
        ends = [at for at in (self._held.find("\n"), self._held.find("<")) if at != -1]
        name_end = min(ends, default=-1)
        name = self._held[:name_end].strip(JSON_SPACE)
        names = None if self._signatures is None else self._signatures.keys()
        if name_end != -1 and may_name(names, name):
            self._open_call(out, name)
            self._held, self._state = self._held[name_end:], "between"
            return True
        if name_end == -1 and len(self._held) <= NAME_LIMIT and not final:
            return False
        self._content(out, CALL_OPEN)  # not a call: content, and what followed is read again
        self._state = "outside"
        return True

    def _between(self, out: list[Piece], final: bool) -> bool:
        """Between arguments: the next key, or </tool_call>."""
        self._held = self._held.lstrip(JSON_SPACE)
        if self._held.startswith(KEY_OPEN):
            self._held, self._state = self._held[len(KEY_OPEN):], "name"
            return True
        if self._held.startswith(CALL_CLOSE):
            self._held = self._held[len(CALL_CLOSE):]
            self._close_call(out)
            return True
        return self._wait_or_skip(out, final, KEY_OPEN, CALL_CLOSE)

    def _name(self, out: list[Piece], final: bool) -> bool:
        """After <arg_key>: the key, </arg_key>, whitespace and <arg_value>; then its value."""
        end = self._held.find(KEY_CLOSE)
        rest = self._held[end + len(KEY_CLOSE):].lstrip(JSON_SPACE)
        if end == -1 and len(self._held) <= NAME_LIMIT + len(KEY_CLOSE) or \
                end != -1 and VALUE_OPEN.startswith(rest) and rest != VALUE_OPEN:
            return self._wait_or_close(out, final)  # (the key, or the value's tag, may still come)
        if end == -1 or not rest.startswith(VALUE_OPEN):
            self._state = "skip"
            return True
        key = self._held[:end].strip(JSON_SPACE)
        self._held = rest[len(VALUE_OPEN):]
        self._begin_value(key)
        return True
