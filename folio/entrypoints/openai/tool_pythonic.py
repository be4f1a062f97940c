"""Pythonic tool calls (vLLM's `--tool-call-parser pythonic`): the grammar that makes a model write them, and the
reader that reads them back.

Llama 3.2 Instruct (with vLLM's pythonic template), Llama 4 and ToolACE answer a call as a Python list of calls
with keyword arguments whose values are Python literals (Llama 4 may wrap it in <|python_start|>/<|python_end|>):

    [get_weather(city="Paris", days=3), get_time(tz="UTC", dst=True, offset=None)]

By tool_choice, the grammar (llguidance's Lark dialect, as tool_grammar's) allows:
  * "required": one call (several, ", " between them, with parallel_tool_calls) in "[...]";
  * a named function: one call of it;
  * "auto": calls, or text whose first non-space character is not "[" (nor "[" after <|python_start|>); with a JSON
    format for the message, that message or calls.
A call's keyword arguments come in the order of the schema's `properties` (then any `required` name that
`properties` leaves out, of the additionalProperties' schema), `name=value` with ", " between them: the required
ones always, each optional one present or not. Values are Python literals of the property's schema:
  * boolean and null are True/False and None; an enum or const of scalars is its members as Python literals; an
    `anyOf` is any of its branches' values; a `$ref` alone (Pydantic's Enum) is what it points to;
  * strings and numbers are llguidance's JSON of their schema (`%json`, so pattern, format, lengths and bounds hold):
    its strings escape only \\" \\\\ \\b \\f \\n \\r \\t, which Python reads as JSON does, and its numbers are
    Python's (the reader sends a number's text as written: Python's value of 1e999 would be inf);
  * anything else (arrays, objects, oneOf, ...) is `%json` of the property's schema (and the function's $defs), the
    only way to hold every JSON Schema keyword; its true/false/null, which Python would not read, the reader takes
    as JSON's values (so a model writes True/False/None at the top level, and JSON's names inside containers only).
A tool whose call could not be written (a name, or a required property's name, that is not a Python identifier; a
required property whose schema is `false`; a `parameters` keyword beside properties/required that keyword
arguments cannot enforce; parameters whose type is not an object) is refused with a ValueError (a 400) naming
it. An optional property whose name is not an identifier is left out.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_grammar import (ANNOTATIONS, ToolChoice, arguments_schema, chosen_tools,
                                                   grammar_json, grammar_literal)
from folio.entrypoints.openai.tool_parser import (JSON_SPACE, BracketEnd, CallEnd, Piece, ToolCallReader,
                                                  arguments_text, call_opening, may_name)
from folio.structured_output.params import StructuredOutputsParams

SEPARATOR = ", "
LIST_OPEN = "<|python_start|>"  # Llama 4's wrapper, read (never written) around a list
LIST_CLOSE = "<|python_end|>"
_SCALAR_TYPES = frozenset({"string", "integer", "number", "boolean", "null"})
_SCALAR_KEYWORDS = frozenset({"type", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                              "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})  # none applies to bool/null
_PARAMETERS_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                                  "$schema", "$id"}) | ANNOTATIONS
_JSON_NAMES = frozenset({"true", "false", "null"})  # what %json writes inside containers
_JSON_NUMBER = re.compile(r"(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # (the sign is an operator in Python)
# The start of a list that may still be calls: "[", a name, "(" (the name checked once whole).
_MAY_START = re.compile(r"\[[ \t\r\n]*([^\W\d]\w*[ \t\r\n]*)?")
_CALL_START = re.compile(r"\[[ \t\r\n]*([^\W\d]\w*)[ \t\r\n]*\(")
_LIST_START = r"[ \t\r\n]*(<\|python_start\|>[ \t\r\n]*)?\["  # (a regex: what the reader reads as a list's start)
_HEAD_LIMIT = 256  # characters of a list's start checked for a call's opening while it streams


def _python_literal(value: object) -> str:
    """A JSON scalar as the Python literal that reads back as it (strings with their characters as they are: JSON's
    \\u escapes of an astral character would read back as two surrogates)."""
    return repr(value) if value is None or isinstance(value, bool) else json.dumps(value, ensure_ascii=False)


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, bool, int, float))


def _has_type(value: object, types: Optional[list]) -> bool:
    """Whether a JSON scalar is of one of the schema's types (None: any)."""
    if types is None:
        return True
    if value is None or isinstance(value, bool):
        return ("null" if value is None else "boolean") in types
    if isinstance(value, str):
        return "string" in types
    return "number" in types or ("integer" in types and float(value).is_integer())


def _value(schema: object, defs: dict, seen: frozenset = frozenset()) -> Optional[str]:
    """A property's values as a grammar rule's body, Python literals (see the module's docstring); None where the
    schema allows no value. defs: the function's $defs, where a $ref points (a $ref alone is followed, as Pydantic
    writes an Enum's, unless it was already: seen)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - ANNOTATIONS
    ref = schema.get("$ref")
    if keys == {"$ref"} and isinstance(ref, str) and ref not in seen:
        kind, _, name = ref.removeprefix("#/").partition("/")
        if isinstance(defs.get(kind), dict) and name in defs[kind] and "/" not in name and "~" not in name:
            return _value(defs[kind][name], defs, seen | {ref})
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if keys == {"anyOf"} and isinstance(schema["anyOf"], list):
        branches = [branch for branch in (_value(s, defs, seen) for s in schema["anyOf"]) if branch is not None]
        return " | ".join(f"({branch})" for branch in branches) or None
    if keys in ({"enum"}, {"const"}, {"type", "enum"}, {"type", "const"}):
        members = schema["enum"] if "enum" in keys else [schema["const"]]
        if isinstance(members, list) and all(_is_scalar(m) for m in members):
            literals = dict.fromkeys(_python_literal(m) for m in members if _has_type(m, types))
            return " | ".join(grammar_literal(literal) for literal in literals) or None
    if isinstance(types, list) and types and set(types) <= _SCALAR_TYPES and keys <= _SCALAR_KEYWORDS:
        words = {"boolean": '"True" | "False"', "null": '"None"'}
        return " | ".join(words.get(t) or grammar_json({**schema, "type": t}) for t in dict.fromkeys(types))
    return grammar_json({**schema, **defs})


def _is_keyword_name(name: str) -> bool:
    """Whether a Python call can take `name` as a keyword and give it back unchanged (ast normalises names NFKC)."""
    return name.isidentifier() and not keyword.iskeyword(name) and unicodedata.normalize("NFKC", name) == name


def _call_rules(i: int, tool: ChatTool) -> list[str]:
    """Rules `call_{i}` (one call of the tool) and its arguments' chain: `first_{i}_{j}` writes the arguments from
    property j on, `rest_{i}_{j}` the same each after ", " (so an optional argument left out leaves no separator)."""
    name = tool.function.name
    if not _is_keyword_name(name):
        raise ValueError(f"function {name!r}: the pythonic tool-call format calls functions by Python names")
    parameters = arguments_schema(tool)
    extra = sorted(set(parameters) - _PARAMETERS_KEYWORDS)
    if extra:
        raise ValueError(f"function {name!r}: the pythonic tool-call format writes keyword arguments from its "
                         f"parameters' properties and required, and cannot enforce {', '.join(extra)}")
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    arguments = []  # (rule body, required)
    for prop in dict.fromkeys([*properties, *required]):
        value = _value(properties.get(prop, parameters.get("additionalProperties", True)), defs)
        if prop in required and (value is None or not _is_keyword_name(prop)):
            why = "its schema allows no value" if value is None else "it is not a Python name"
            raise ValueError(f"function {name!r}: its required parameter {prop!r} cannot be written as a keyword "
                             f"argument ({why})")
        if value is not None and _is_keyword_name(prop):
            arguments.append((f"{grammar_literal(prop + '=')} ({value})", prop in required))
    n = len(arguments)
    rules = [f"call_{i}: {grammar_literal(name + '(')} first_{i}_0 {grammar_literal(')')}",
             f'first_{i}_{n}: ""', f'rest_{i}_{n}: ""']
    for j, (argument, needed) in enumerate(arguments):
        rules += [f"first_{i}_{j}: {argument} rest_{i}_{j + 1}" + ("" if needed else f" | first_{i}_{j + 1}"),
                  f"rest_{i}_{j}: {grammar_literal(SEPARATOR)} {argument} rest_{i}_{j + 1}"
                  + ("" if needed else f" | rest_{i}_{j + 1}")]
    return rules


def pythonic_constraint(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                        message_schema: Optional[dict] = None) -> Optional[StructuredOutputsParams]:
    """The grammar for a validated tool_choice, or None for "none" (tool_grammar.hermes_constraint's contract, in
    the pythonic format); ValueError for a tool it cannot write."""
    if tool_choice == "none":
        return None
    tools, several = chosen_tools(tools, tool_choice, parallel_tool_calls)
    more = f" ({grammar_literal(SEPARATOR)} call)*" if several else ""
    lines = ["%llguidance {}", f'calls: "[" call{more} "]"']
    if tool_choice == "auto" and message_schema is not None:
        lines += ["start: calls | message", f"message: {grammar_json(message_schema)}"]
    elif tool_choice == "auto":
        lines += ["start: calls | TEXT", f"TEXT: /(.|\\n)*/ & ~/{_LIST_START}(.|\\n)*/"]  # text that is not a list
    else:
        lines += ["start: calls"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        lines += _call_rules(i, tool)
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


class _NotCall(Exception):
    """A list element, or a value in it, that is not a call of the request's functions with literal arguments."""


class _Source:
    """The text ast parsed, to take a node's own text from (ast gives lines, and columns in UTF-8 bytes)."""

    def __init__(self, text: str) -> None:
        self._bytes = text.encode("utf-8", "surrogatepass")
        self._line_starts = [0] + [match.end() for match in re.finditer(rb"\r\n|\r|\n", self._bytes)]

    def text(self, node: ast.expr) -> str:
        start = self._line_starts[node.lineno - 1] + node.col_offset
        return self._bytes[start:self._line_starts[node.end_lineno - 1] + node.end_col_offset].decode("utf-8")


def _number_text(node: ast.Constant, source: _Source) -> str:
    """A number literal's JSON text: as written where it is JSON's (Python's value may differ: 1e999 is inf,
    1.0000000000000000001 is 1.0), else the number's (0x10 is 16, 1_000 is 1000)."""
    written = source.text(node)
    if _JSON_NUMBER.fullmatch(written):
        return written
    if isinstance(node.value, float) and not math.isfinite(node.value):  # (1_0e999), which JSON cannot carry
        raise _NotCall
    return repr(node.value)


def _json_text(node: ast.expr, source: _Source) -> str:
    """A Python literal's JSON text: strings, numbers (their text: _number_text), True/False/None (and JSON's
    true/false/null names), lists, dicts with string keys (a key written twice has its last value, as in
    Python)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number_text(node, source)
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool))):
        return arguments_text(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return ("-" if isinstance(node.op, ast.USub) else "") + _number_text(node.operand, source)
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return node.id
    if isinstance(node, ast.List):
        return "[" + ", ".join(_json_text(element, source) for element in node.elts) + "]"
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return _object_text({k.value: _json_text(v, source) for k, v in zip(node.keys, node.values)})
    raise _NotCall


def _object_text(members: dict[str, str]) -> str:
    """A JSON object's text from its members' keys and values' JSON text."""
    return "{" + ", ".join(f"{arguments_text(key)}: {value}" for key, value in members.items()) + "}"


def _read_calls(text: str, names: Optional[Collection[str]]) -> Optional[list[tuple[str, str]]]:
    """A closed list's calls (name, arguments' JSON text), or None where it is not a list of calls of the request's
    functions with keyword arguments that are literals."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        source = _Source(text)
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args or \
                    not may_name(names, call.func.id) or any(k.arg is None for k in call.keywords) or \
                    len({k.arg for k in call.keywords}) < len(call.keywords):  # (ast leaves repeats to the compiler)
                return None
            calls.append((call.func.id, _object_text({k.arg: _json_text(k.value, source) for k in call.keywords})))
        return calls
    except (_NotCall, SyntaxError, ValueError, RecursionError, MemoryError):  # (a model without the grammar may nest
        return None  # without end, or write an integer past Python's digit limit)


@dataclass
class _Skip:
    """Skips what may come before a list or after it: whitespace, then maybe `tag` (Llama 4's wrapper, where the
    special tokens' text is kept) and whitespace. Fed piece by piece; `text()` is what it was fed, to be given back
    where it turns out to be content."""

    tag: str
    parts: list[str] = field(default_factory=list)
    tag_part: str = ""  # the start of the tag, while it may be the tag
    after_tag: bool = False

    def feed(self, text: str) -> Optional[str]:
        """The text from its first character that is not skipped (a suffix of text, or the tag's false start and
        the rest); None while all of it was skipped or may be."""
        self.parts.append(text)
        rest = text if self.tag_part else text.lstrip(JSON_SPACE)
        if not self.after_tag and (self.tag_part or rest.startswith(self.tag[0])):
            seen = self.tag_part + rest
            if len(seen) < len(self.tag) and self.tag.startswith(seen):
                self.tag_part = seen
                return None
            if not seen.startswith(self.tag):
                return seen
            self.tag_part, self.after_tag, rest = "", True, seen[len(self.tag):].lstrip(JSON_SPACE)
        return rest or None

    def text(self) -> str:
        return "".join(self.parts)


class PythonicToolCallReader(ToolCallReader):
    """One choice's reader. An answer whose first non-space character is "[" (after <|python_start|> too) may be a
    call list: it is held back until the list closes, then read whole (Python's ast, once) and its calls sent
    whole, all at once (a call is only known to be one once the whole list is calls); whitespace and
    <|python_end|> after it are dropped, and text that follows is content. Any other answer is content, streamed
    as it comes; so is a list that is not calls of the request's functions with literal keyword arguments, as soon
    as it is known not to be: its start is not "[name(" with a function's name, it closed, or the text ended
    first. Work per piece is the piece's length: the list's brackets and strings are followed as they come."""

    def __init__(self, names: Optional[Collection[str]] = None) -> None:
        super().__init__()
        self._names = None if names is None else frozenset(names)
        self._mode = "start"  # "start" (before the first character that counts), "list", "after", "content"
        self._skip = _Skip(LIST_OPEN)  # what may come before the list, then (a new one) after it
        self._before = ""  # the text before the list's "["
        self._list: list[str] = []  # the open list's text, in parts
        self._head = ""  # its first _HEAD_LIMIT characters
        self._opens_call = False  # its head is "[name(" with a function's name
        self._list_end = BracketEnd("[](){}", "'\"")  # follows the open list's brackets and strings

    def pieces(self, text: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "start" and text:
            rest = self._skip.feed(text)
            if rest is not None and rest.startswith("["):
                fed = self._skip.text()
                self._mode, self._before, text = "list", fed[:len(fed) - len(rest)], rest
            elif rest is not None:
                self._to_content(out, self._skip.text())
                text = ""
        if self._mode == "list" and text:
            text = self._read_list(text, out)
        if self._mode == "after" and text:
            rest = self._skip.feed(text)
            if rest is not None:
                self._to_content(out, rest)
        elif self._mode == "content" and text:
            out.append(text)
        if final and self._mode == "start":  # nothing but what may come before a list
            self._to_content(out, self._skip.text())
        elif final and self._mode == "list":  # a list cut off
            self._to_content(out, self._before + "".join(self._list))
        elif final and self._mode == "after":
            self._to_content(out, self._skip.tag_part)  # the start of <|python_end|>, and no more of it
        return out

    def _read_list(self, text: str, out: list[Piece]) -> str:
        """Follow the open list through text: what is left after it closes and its calls went out; "" while it is
        open, or when it turned out to be content (all of text then went out)."""
        end = self._list_end.feed(text)
        own = text if end == -1 else text[:end]
        self._list.append(own)
        if len(self._head) < _HEAD_LIMIT:
            self._head = (self._head + own)[:_HEAD_LIMIT]
        calls = None
        if self._may_be_calls(closed=end != -1):
            if end == -1:
                return ""
            calls = _read_calls("".join(self._list), self._names)
        if calls is None:
            self._to_content(out, self._before + "".join(self._list) + text[len(own):])
            return ""
        for name, arguments in calls:
            out += [call_opening(self.num_calls, name, arguments), CallEnd(self.num_calls)]
            self.num_calls += 1
        self._mode, self._list, self._skip = "after", [], _Skip(LIST_CLOSE)
        return text[end:]

    def _may_be_calls(self, closed: bool) -> bool:
        """Whether the list may still be calls, by its head: "[name(" with a function's name, or, while the list is
        open, the start of that (so that text in brackets goes out before its list closes). The head alone decides,
        and it only grows, so any split of the text decides alike."""
        if not self._opens_call:
            start = _CALL_START.match(self._head)
            if start is None:
                return not closed and _MAY_START.fullmatch(self._head) is not None
            self._opens_call = may_name(self._names, unicodedata.normalize("NFKC", start.group(1)))
        return self._opens_call

    def _to_content(self, out: list[Piece], text: str) -> None:
        """The rest of the choice is content, starting with text."""
        self._mode, self._list = "content", []
        if text:
            out.append(text)
