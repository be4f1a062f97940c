"""Qwen3-Coder's XML-style tool calls (vLLM's `--tool-call-parser qwen3_coder`): the grammar that makes a model write
them, and the reader that reads them back by the functions' schemas.

Qwen3-Coder (and later Qwen models) write each call as a block, several calls as several blocks, as their chat
template renders the history's calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A string's value is the raw text between the newlines (no quotes, no escapes); any other value is its JSON text.
So a value's meaning depends on its parameter's schema, and the reader is given the request's tools: "3" is the
string "3" for a string parameter and the number 3 for an integer one.

How each parameter's value is written follows from its schema (ValueForm): raw text for a schema whose values are
exactly all strings (a description, a default and such annotations aside), where the text cannot hold
"\\n</parameter>", which ends it; the literal strings for an enum (or const) of strings; either of these with the
text "null" for None where the schema also takes null (Optional[str], as the template renders None); raw text
read as JSON where it parses, else as the string, for a schema that takes anything; and the value's JSON text for
every other schema: numbers, booleans, arrays, objects, and strings the raw form cannot bound (pattern,
maxLength, format, a mix of strings and other types), which are then written JSON-quoted. The reader reads each
form back as its grammar wrote it, so whatever the grammar allows reads back as arguments valid by the schema (a
JSON value goes into them as its text as written: Python would make 1e999 inf, which no JSON holds).

By tool_choice, the grammar (llguidance's Lark dialect, as tool_grammar's) allows:
  * "required": calls only (one, or several with parallel_tool_calls, a newline between them);
  * a named function: one call of it;
  * "auto": free text, but once the model writes "<tool_call>" the call must be well formed (the Hermes grammar's
    lazy trigger); with a JSON format for the message, that message or calls.
A call's parameters come in the order of the schema's `properties` (as clients build the arguments the template
shows the model), each required one written, each optional one written or left out; required names the
properties do not declare follow, in `required`'s order. A schema without properties takes further parameters by
any plain name (of its additionalProperties' schema). Top-level keywords that constrain the object as a whole
(anyOf, minProperties, patternProperties, ...) and a required property whose name holds ">" (which would end
the name) or whose schema takes no value (false, an empty enum or anyOf) cannot be written this way: such tools
are a 400 naming them (an optional such property is left out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from folio.entrypoints.openai.protocol import ChatTool, DeltaFunctionCall, DeltaToolCall
from folio.entrypoints.openai.tool_grammar import (ANNOTATIONS, CALL_CLOSE, CALL_OPEN, ToolChoice, arguments_schema,
                                                   call_alternatives, chosen_tools, grammar_json, grammar_literal,
                                                   tagged_calls_start)
from folio.entrypoints.openai.tool_parser import (JSON_SPACE, CallEnd, JsonNumber, Piece, ToolCallReader,
                                                  arguments_text, call_opening, may_name, read_json, until_tag)
from folio.structured_output.params import StructuredOutputsParams

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
NEWLINE = "\n"
VALUE_END = "\n</parameter>"  # what ends a value: the first one after it begins
NAME_LIMIT = 256  # characters of a function's or parameter's name read before the call is taken as not one
_OBJECT_KEYWORDS = ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                                  "$schema"}
_EXTRA_NAME = r"/[A-Za-z_][A-Za-z0-9_.\-]{0,63}/"  # a parameter's name beyond the declared ones
_LOCAL_REF = re.compile(r"#/(\$defs|definitions)/([^/~]+)")
_JSON_TYPES = {type(None): "null", bool: "boolean", str: "string", list: "array", dict: "object"}


@dataclass(frozen=True)
class _Strings:
    """The values of a schema that takes strings and null only: every string or some, and null or not."""

    every: bool
    some: frozenset
    null: bool

    def __or__(self, other: "_Strings") -> "_Strings":
        return _Strings(self.every or other.every, self.some | other.some, self.null or other.null)

    def overlaps(self, other: "_Strings") -> bool:
        return (self.null and other.null) or bool(self.some & other.some) or \
            (self.every and (other.every or bool(other.some))) or (other.every and bool(self.some))


def _resolved(schema: Any, defs: dict, seen: frozenset) -> tuple[Any, frozenset]:
    """schema, with a local $ref (beside annotations only) or a one-branch allOf followed to what it stands for, and
    the refs followed to it, `seen` included; None for a ref already followed (a recursive schema's, whose values
    are then not read as raw strings)."""
    while isinstance(schema, dict) and not set(schema) - ANNOTATIONS - {"$ref", "allOf"}:
        if "$ref" in schema and "allOf" not in schema:
            ref = schema["$ref"]
            match = _LOCAL_REF.fullmatch(ref) if isinstance(ref, str) else None
            target = defs.get(match.group(1), {}).get(match.group(2)) if match else None
            if target is None:
                break
            if ref in seen:
                return None, seen
            schema, seen = target, seen | {ref}
        elif "allOf" in schema and "$ref" not in schema and isinstance(schema["allOf"], list) and \
                len(schema["allOf"]) == 1:
            schema = schema["allOf"][0]
        else:
            break
    return schema, seen


def _strings(schema: Any, defs: dict, seen: frozenset = frozenset()) -> Optional[_Strings]:
    """What a schema takes, where that is strings and null only and nothing narrows the strings but an enum; None
    otherwise (the value is then written as JSON). seen: the refs followed to schema (a recursive schema is not
    strings only, whatever its branches)."""
    schema, seen = _resolved(schema, defs, seen)
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - ANNOTATIONS
    types = schema.get("type", ["string", "null"])
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or set(types) - {"string", "null"}:
        return None
    if keys <= {"type"} and "type" in schema:
        return _Strings("string" in types, frozenset(), "null" in types)
    if keys in ({"enum"}, {"enum", "type"}, {"const"}, {"const", "type"}):
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or any(v is not None and not isinstance(v, str) for v in values):
            return None
        return _Strings(False, frozenset(v for v in values if isinstance(v, str) and "string" in types),
                        None in values and "null" in types)
    if len(keys) == 1 and keys <= {"anyOf", "oneOf"}:
        branches = schema.get("anyOf", schema.get("oneOf"))
        parts = [_strings(branch, defs, seen) for branch in branches] if isinstance(branches, list) and branches \
            else [None]
        if any(part is None for part in parts):
            return None
        if "oneOf" in keys and any(a.overlaps(b) for i, a in enumerate(parts) for b in parts[i + 1:]):
            return None  # (a value two branches take is no value of a oneOf)
        union = parts[0]
        for part in parts[1:]:
            union |= part
        return union
    return None


def _allows_nothing(schema: Any) -> bool:
    """Whether a schema takes no value at all (false, an empty enum or anyOf or oneOf), which no grammar can
    write."""
    if schema is False:
        return True
    return isinstance(schema, dict) and any(schema.get(key) == [] for key in ("enum", "anyOf", "oneOf"))


def _has_type(value: Any, schema: Any) -> bool:
    """Whether a value (read_json's) is of a type the schema names (any where it names none)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    if types is None:
        return True
    types = [types] if isinstance(types, str) else types
    if isinstance(value, JsonNumber):
        return "number" in types or ("integer" in types and value.is_integer())
    return _JSON_TYPES.get(type(value)) in types


@dataclass(frozen=True)
class ValueForm:
    """How one parameter's value is written and read back.

    kind "text": raw text, the string itself (within `choices` where given; "null" is None where `nullable`);
    "any": raw text, its JSON value where it parses, else the string (a schema that takes anything);
    "json": the value's JSON text, of `schema` (read leniently where the grammar did not write it: the text
    itself where it is not JSON of the schema's type). A JSON value goes into the arguments as its text, as
    written: its numbers are the model's, whatever Python would make of them (1e999, 5000 digits)."""

    kind: str
    schema: Any = None
    choices: Optional[tuple[str, ...]] = None
    nullable: bool = False

    @staticmethod
    def of(schema: Any, defs: dict) -> "ValueForm":
        """The form of a property's schema; defs: the function's $defs, which its $refs point into."""
        strings = _strings(schema, defs)
        if strings is not None and strings.every:
            return ValueForm("text", nullable=strings.null)
        if strings is not None and (strings.some or strings.null) and not (strings.null and "null" in strings.some) \
                and not any(VALUE_END in choice for choice in strings.some):
            return ValueForm("text", choices=tuple(sorted(strings.some)), nullable=strings.null)
        if schema is True or (isinstance(schema, dict) and not set(schema) - ANNOTATIONS):
            return ValueForm("any")
        return ValueForm("json", {**schema, **defs} if isinstance(schema, dict) else schema)

    def grammar(self) -> str:
        """The value's grammar, with the end of the parameter ("\\n</parameter>\\n")."""
        end = VALUE_END + "\n"
        if self.kind == "json":
            return f"{grammar_json(self.schema)} {grammar_literal(end)}"
        if self.choices is None:
            return 'raw_value "\\n"'
        choices = self.choices + (("null",) if self.nullable else ())
        return "(" + " | ".join(grammar_literal(choice + end) for choice in choices) + ")"

    def json_text(self, text: str) -> str:
        """The value's JSON text in the arguments, from its text in the call."""
        if self.kind == "text":
            return "null" if self.nullable and text == "null" else arguments_text(text)
        try:
            value = read_json(text)
        except ValueError:
            return arguments_text(text)
        return text.strip(JSON_SPACE) if self.kind == "any" or _has_type(value, self.schema) else arguments_text(text)

    def streams(self) -> bool:
        """Whether the value's text goes out as it comes (a raw string's, once it cannot be "null")."""
        return self.kind == "text" and self.choices is None


RAW_STRING = ValueForm("text")  # a parameter the schema does not declare, read as vLLM reads it


@dataclass(frozen=True)
class Parameter:
    name: str
    form: ValueForm
    required: bool


@dataclass(frozen=True)
class Signature:
    """A function's parameters as the format writes them: in the grammar's order, and the form of further ones
    (None: the grammar writes no others)."""

    parameters: tuple[Parameter, ...]
    extra: Optional[ValueForm]

    @staticmethod
    def of(tool: ChatTool, strict: bool = True) -> "Signature":
        """strict: ValueError where the format cannot write every call the schema takes (the grammar's use); not
        strict, the forms the reader reads by, whatever the schema."""
        name, schema = tool.function.name, arguments_schema(tool) if strict else tool.function.parameters or {}
        defs = {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [key for key in schema.get("required", ()) if isinstance(key, str)]
        additional = schema.get("additionalProperties", True)
        problem = _object_problem(schema) if strict else None
        parameters = []
        for key in list(properties) + [key for key in required if key not in properties]:
            property_schema = properties.get(key, additional)
            if ">" in key or len(key) > NAME_LIMIT or _allows_nothing(property_schema):
                if key in required:
                    problem = problem or f"its required parameter {key!r} cannot be written"
                continue
            parameters.append(Parameter(key, ValueForm.of(property_schema, defs), key in required))
        if strict and problem is not None:
            raise ValueError(f"tools: the qwen3_coder format writes a call's parameters one by one, and cannot "
                             f"write every call of {name!r}: {problem}")
        extra = None if properties or additional is False else ValueForm.of(additional, defs)
        return Signature(tuple(parameters), extra)

    def form(self, key: str) -> ValueForm:
        """How the reader reads parameter `key`'s value."""
        for parameter in self.parameters:
            if parameter.name == key:
                return parameter.form
        return self.extra or RAW_STRING


def _object_problem(schema: dict) -> Optional[str]:
    """Why the parameters' schema (an object's: arguments_schema's) constrains its object beyond what parameter by
    parameter can write, or None."""
    beyond = sorted(set(schema) - _OBJECT_KEYWORDS)
    return f"its parameters' schema has {', '.join(beyond)}" if beyond else None


def _call_rule(tool: ChatTool) -> str:
    """One call's text after CALL_OPEN: the name forced, the parameters in the schema's order."""
    signature = Signature.of(tool)
    parts = [grammar_literal("\n" + FUNCTION_OPEN + tool.function.name + ">\n")]
    for parameter in signature.parameters:
        written = f"({grammar_literal(PARAMETER_OPEN + parameter.name + '>' + NEWLINE)} {parameter.form.grammar()})"
        parts.append(written if parameter.required else written + "?")
    if signature.extra is not None:
        parts.append(f"({grammar_literal(PARAMETER_OPEN)} EXTRA_NAME {grammar_literal('>' + NEWLINE)} "
                     f"{signature.extra.grammar()})*")
    parts.append(grammar_literal(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"))
    return " ".join(parts)


def qwen3_coder_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                           message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's contract, in
    Qwen3-Coder's format); ValueError naming tools whose schema the format cannot write."""
    return tagged_values_constraint(tools, tool_choice, parallel_tool_calls, message_schema, _call_rule, VALUE_END)


def tagged_values_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                             message_schema: Optional[dict], call_rule: Callable[[ChatTool], str],
                             value_end: str) -> Optional[StructuredOutputsParams]:
    """The grammar of a format that writes a call's arguments one tagged value each (Qwen3-Coder's, GLM-4.5's), given
    its rule of one tool's call and what ends a raw value."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    lines = ["%llguidance {}", *tagged_calls_start(tool_choice, several, message_schema),
             *call_alternatives(tools, call_rule),
             f"raw_value[lazy]: RAW {grammar_literal(value_end)}", r"RAW: /(.|\n)*/", f"EXTRA_NAME: {_EXTRA_NAME}"]
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


class Qwen3CoderToolCallReader(ToolCallReader):
    """One choice's reader, given the request's tools (None: any function, every value a string).

    Text outside `<tool_call>...</tool_call>` is content (whitespace after a call dropped). A call streams: its
    opening delta (id, type, name) once `<function=NAME>` has come, then its arguments' JSON text parameter by
    parameter as each value ends, a raw string's text as it comes; "}" when the call closes. The structure is
    followed as written (a value ends at the first "\\n</parameter>" only, so a raw value may hold anything
    else); a block whose start is not `<function=` and one of the request's functions stays content. Past its
    name, text that breaks the structure is skipped to `</tool_call>`, the parameters read so far kept (as at the
    end of the text, where a value cut off keeps its text). A parameter written twice keeps its first value.
    Work per piece is the piece's length: only a marker's or a name's unfinished start is held back."""

    value_end = VALUE_END  # what ends a value: the first one after it begins

    def __init__(self, tools: Optional[list[ChatTool]] = None) -> None:
        super().__init__()
        self._signatures = None if tools is None else {t.function.name: Signature.of(t, strict=False) for t in tools}
        self._state = "outside"  # outside, head, between, name, value, function_end, skip
        self._held = ""  # text not consumed yet: an unfinished marker or name
        self._index = 0  # the open call's
        self._signature = Signature((), None)  # the open call's function's
        self._written: set[str] = set()  # its parameters so far
        self._parameter: Optional[tuple[str, ValueForm]] = None  # the value being read: whose, and its form (None:
        self._value: list[str] = []  # a repeat, skipped) and its text not sent
        self._streaming = False  # the value's text goes out as it comes: its opening quote is out
        self._sent_any = False  # some of the open call's arguments went out: "{" and a parameter

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        self._held += text
        step = {"outside": self._outside, "head": self._head, "between": self._between, "name": self._name,
                "value": self._value_text, "function_end": self._function_end, "skip": self._skip}
        while step[self._state](out, final):
            pass
        return out

    # Each step consumes what it can of self._held and says whether to go on (False: it needs more text).

    def _outside(self, out: list[Piece], final: bool) -> bool:
        before, self._held, found = until_tag(self._held, CALL_OPEN, final)
        self._content(out, before)
        if found:
            self._state = "head"
        return found

    def _head(self, out: list[Piece], final: bool) -> bool:
        """After <tool_call>: `<function=NAME>`, the name one of the request's functions."""
        head = self._held.lstrip(JSON_SPACE)
        name_end = head.find(">") if head.startswith(FUNCTION_OPEN) else -1
        name = head[len(FUNCTION_OPEN):name_end] if name_end != -1 else head[len(FUNCTION_OPEN):]
        names = None if self._signatures is None else self._signatures.keys()
        if name_end != -1 and may_name(names, name):
            self._open_call(out, name)
            self._held, self._state = head[name_end + 1:], "between"
            return True
        may_come = name_end == -1 and len(self._held) - len(head) <= NAME_LIMIT and len(name) <= NAME_LIMIT and (
            FUNCTION_OPEN.startswith(head) or (head.startswith(FUNCTION_OPEN) and (
                names is None or any(n.startswith(name) for n in names))))
        if may_come and not final:
            return False
        self._content(out, CALL_OPEN)  # not a call: content, and what followed is read again
        self._state = "outside"
        return True

    def _between(self, out: list[Piece], final: bool) -> bool:
        """Between parameters: the next one, or </function>."""
        self._held = self._held.lstrip(JSON_SPACE)
        for marker, state in ((PARAMETER_OPEN, "name"), (FUNCTION_CLOSE, "function_end")):
            if self._held.startswith(marker):
                self._held, self._state = self._held[len(marker):], state
                return True
        return self._wait_or_skip(out, final, PARAMETER_OPEN, FUNCTION_CLOSE)

    def _name(self, out: list[Piece], final: bool) -> bool:
        """After <parameter=: the name, ">" and a newline; then its value."""
        end = self._held.find(">")
        if end == -1 or end + 1 == len(self._held):
            if len(self._held) > NAME_LIMIT + 1:
                self._state = "skip"
                return True
            return self._wait_or_close(out, final)
        key, rest = self._held[:end], self._held[end + 1:]
        self._held = rest[1:] if rest.startswith("\n") else rest
        self._begin_value(key)
        return True

    def _begin_value(self, key: str) -> None:
        """The value of parameter `key` comes next (a parameter given twice keeps its first value)."""
        self._parameter = (key, self._signature.form(key)) if key not in self._written else None
        self._written.add(key)
        self._value, self._streaming, self._state = [], False, "value"

    def _value_text(self, out: list[Piece], final: bool) -> bool:
        """A value, up to the first value_end."""
        value, self._held, found = until_tag(self._held, self.value_end, final)
        self._add_value(out, value)
        if found or final:
            self._end_value(out)
        if found:
            self._state = "between"
        elif final:
            self._close_call(out)
        return found

    def _function_end(self, out: list[Piece], final: bool) -> bool:
        """After </function>: </tool_call>."""
        self._held = self._held.lstrip(JSON_SPACE)
        if self._held.startswith(CALL_CLOSE):
            self._held = self._held[len(CALL_CLOSE):]
            self._close_call(out)
            return True
        return self._wait_or_skip(out, final, CALL_CLOSE)

    def _skip(self, out: list[Piece], final: bool) -> bool:
        """A call whose structure broke: its text up to </tool_call> dropped."""
        _, self._held, found = until_tag(self._held, CALL_CLOSE, final)
        if not found:
            return self._wait_or_close(out, final)
        self._close_call(out)
        return True

    def _wait_or_skip(self, out: list[Piece], final: bool, *markers: str) -> bool:
        """Held text that is no marker's start breaks the call; a start waits for more (the end of the text closes
        the call)."""
        if not any(marker.startswith(self._held) for marker in markers):
            self._state = "skip"
            return True
        return self._wait_or_close(out, final)

    def _wait_or_close(self, out: list[Piece], final: bool) -> bool:
        if final:
            self._held = ""
            self._close_call(out)
        return False

    def _open_call(self, out: list[Piece], name: str) -> None:
        self._index = self.num_calls
        self._signature = Signature((), None) if self._signatures is None else self._signatures[name]
        self._written, self._parameter, self._sent_any = set(), None, False
        out.append(call_opening(self._index, name))

    def _add_value(self, out: list[Piece], text: str) -> None:
        if self._parameter is None or not text:
            return
        key, form = self._parameter
        if self._streaming:
            self._arguments(out, arguments_text(text)[1:-1])
            return
        self._value.append(text)
        if not form.streams():
            return  # (joined once, when it ends)
        value = "".join(self._value)  # (joined only while it may be "null": 4 characters and the piece)
        if not (form.nullable and "null".startswith(value)):
            self._arguments(out, f"{self._separator()}{arguments_text(key)}: {arguments_text(value)[:-1]}")
            self._value, self._streaming = [], True

    def _end_value(self, out: list[Piece]) -> None:
        if self._parameter is None:
            return
        key, form = self._parameter
        if self._streaming:
            self._arguments(out, '"')
        else:
            self._arguments(out, f"{self._separator()}{arguments_text(key)}: {form.json_text(''.join(self._value))}")
        self._parameter, self._value, self._streaming = None, [], False

    def _separator(self) -> str:
        """What comes before the next parameter's key: the arguments' opening brace, or a comma."""
        separator = ", " if self._sent_any else "{"
        self._sent_any = True
        return separator

    def _close_call(self, out: list[Piece]) -> None:
        self._arguments(out, "}" if self._sent_any else "{}")
        out.append(CallEnd(self._index))
        self.num_calls += 1
        self._state, self._after_call = "outside", True

    def _arguments(self, out: list[Piece], text: str) -> None:
        """A piece of the open call's arguments, joined to the delta before it where that is the call's."""
        last = out[-1] if out else None
        if isinstance(last, DeltaToolCall) and last.index == self._index:
            last.function.arguments = (last.function.arguments or "") + text
        else:
            out.append(DeltaToolCall(index=self._index, function=DeltaFunctionCall(arguments=text)))
