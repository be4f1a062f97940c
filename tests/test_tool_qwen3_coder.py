"""Qwen3-Coder's XML-style tool calls (`--tool-call-parser qwen3_coder`): the reader on any split of the text and by
the functions' schemas; the grammars, whose every output (random walks through them) reads back as calls valid by
the schemas; and the server with a Qwen3-Coder-style template on the tiny qwen3_moe model (Qwen3-Coder's
architecture): tool_choice's grammars make it write calls that come back as tool_calls (chat, streamed and not)
and function_call items (responses)."""

from __future__ import annotations

import json
import random
import sys

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
from folio.entrypoints.openai.tool_parser import CallEnd
from folio.entrypoints.openai.tool_qwen3_coder import Qwen3CoderToolCallReader, qwen3_coder_constraint
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, assert_calls_stream_as_plain, assert_named_call,
                                 assert_responses_call, cut, llguidance_backend, read_pieces, streamed,
                                 tool_server_fixture)
from tool_format_fixture import client  # noqa: F401 (a fixture)
from tool_format_fixture import random_output

FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "description": "free text: raw"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"$ref": "#/$defs/Unit"},  # pydantic's enum: raw choices
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},  # Optional[str]: raw, "null" None
    "code": {"type": "string", "maxLength": 4},  # a bounded string: JSON-quoted
    "id": {"anyOf": [{"type": "string"}, {"type": "integer"}]},  # strings and others: JSON
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    "extra": {},  # anything: raw, JSON where it parses
    "ratio": {"type": "number"}},
    "required": ["city", "days"], "additionalProperties": False,
    "$defs": {"Unit": {"enum": ["C", "F"], "type": "string", "title": "Unit"}}}
TOOL_SCHEMAS = {"forecast": FORECAST,
                "get_time": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
                "anything": None}
TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": schema}})
         for name, schema in TOOL_SCHEMAS.items()]


def read(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]], list]:
    """The content and the calls (name, arguments' JSON text) a choice's pieces give, and every piece read."""
    content, calls, out = read_pieces(Qwen3CoderToolCallReader(tools), pieces)
    return content, [(c.function.name, c.function.arguments) for c in calls], out


def call(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3-Coder writes it (values as given: raw or JSON text)."""
    written = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{written}</function>\n</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    (call("forecast", ("city", "Paris"), ("days", "3")), "", [("forecast", {"city": "Paris", "days": 3})]),
    (call("forecast", ("city", "3"), ("days", "3"), ("ratio", "0.5")), "",  # by the schema: "3" a string, 3 a number
     [("forecast", {"city": "3", "days": 3, "ratio": 0.5})]),
    ("Let me look.\n\n" + call("get_time", ("tz", "UTC")) + "\n" + call("get_time", ("tz", "CET")) + "\n\nDone.",
     "Let me look.\n\nDone.", [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]),
    (call("forecast", ("city", "a</parameter>\n<parameter=x>\n</tool_call>\n"), ("days", "1")), "",  # only
     [("forecast", {"city": "a</parameter>\n<parameter=x>\n</tool_call>\n", "days": 1})]),  # \n</parameter> ends it
    (call("forecast", ("city", "\nline 1\n\nline 2\n"), ("days", "1")), "",
     [("forecast", {"city": "\nline 1\n\nline 2\n", "days": 1})]),
    (call("forecast", ("city", ""), ("note", "null")), "", [("forecast", {"city": "", "note": None})]),
    (call("forecast", ("city", "null"), ("note", "nullable")), "",
     [("forecast", {"city": "null", "note": "nullable"})]),
    (call("forecast", ("unit", "F"), ("code", '"ab\\"c"'), ("id", "7"), ("tags", '["a", "b"]')), "",
     [("forecast", {"unit": "F", "code": 'ab"c', "id": 7, "tags": ["a", "b"]})]),
    (call("forecast", ("code", "abc"), ("days", "many"), ("ratio", "NaN")), "",  # not JSON of the type: the text
     [("forecast", {"code": "abc", "days": "many", "ratio": "NaN"})]),
    (call("forecast", ("extra", '{"a": 1}'), ("city", "x"), ("city", "y")), "",  # the first of two kept
     [("forecast", {"extra": {"a": 1}, "city": "x"})]),
    (call("anything", ("n", "1"), ("s", "word")), "", [("anything", {"n": 1, "s": "word"})]),
    (call("launch", ("x", "1")), call("launch", ("x", "1")), []),  # not one of the tools
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),  # another format's call
    ("<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n<oops>\n</tool_call> after",
     "after", [("get_time", {"tz": "UTC"})]),  # broken after its name: skipped to </tool_call>
    ("<tool_call>\n<function=forecast>\n<parameter=city>\nPar", "", [("forecast", {"city": "Par"})]),  # cut off
    ("<tool_call>\n<function=forec", "<tool_call>\n<function=forec", []),  # cut before its name is known
    ("It is noon.", "It is noon.", []),
    ("", "", []),
])
def test_reads(text, content, calls):
    got_content, got_calls, _ = read([text])
    assert (got_content, [(name, json.loads(arguments)) for name, arguments in got_calls]) == (content, calls)


def test_without_tools_every_value_is_a_string():
    reader = Qwen3CoderToolCallReader(None)
    (opening, end) = reader.pieces(call("f", ("n", "1")), final=True)
    assert opening.function.name == "f" and json.loads(opening.function.arguments) == {"n": "1"} and end.index == 0


BITS = st.sampled_from([call("forecast", ("city", "Oslo"), ("days", "2")), "<tool_call>", "\n<function=get_time>\n",
                        "<function=forecast>", "<parameter=city>\n", "<parameter=note>\n", "<parameter=days>\n",
                        "null", "\n</parameter>", "\n</parameter>\n", "</function>\n</tool_call>", "</tool_call>",
                        "\n", " ", "text", "4", '"x"', "<", ">"])


@settings(max_examples=300, deadline=None)
@given(st.lists(BITS, max_size=10), st.lists(st.integers(0, 300), max_size=6))
def test_any_pieces_read_as_the_whole(bits, cuts):
    text = "".join(bits)
    pieces = cut(text, cuts)
    whole = read([text])
    assert read(pieces)[:2] == whole[:2]
    for _, arguments in whole[1]:
        assert isinstance(json.loads(arguments), dict)  # the arguments are JSON whatever the text


def test_a_call_streams_as_it_comes():
    reader = Qwen3CoderToolCallReader(TOOLS)
    (opening,) = reader.pieces("<tool_call>\n<function=forecast>\n<parameter=note>\nnu")
    assert opening.function.name == "forecast" and opening.id and opening.function.arguments == ""
    assert reader.pieces("l") == []  # still maybe null
    assert [p.function.arguments for p in reader.pieces("lx\n</para")] == ['{"note": "nullx']  # a string, streamed
    assert [p.function.arguments for p in reader.pieces("meter>\n<parameter=days>\n")] == ['"']
    assert [p.function.arguments for p in reader.pieces("5\n</parameter>\n")] == [', "days": 5']
    end = reader.pieces("</function>\n</tool_call>")
    assert end[0].function.arguments == "}" and end[1] == CallEnd(0)


def test_a_long_value_is_joined_once_however_finely_it_comes():
    """Work per piece is the piece's length: a value is kept as its pieces and joined once, when it ends (a raw
    string that may be null, only while it may: 4 characters), never again with each piece (a long value in
    small pieces would cost the square of its length, on the server's event loop)."""
    array, note = json.dumps(["ab"] * 3000), "word " * 3000
    text = call("forecast", ("tags", array), ("note", note), ("extra", array))
    reader, out, joins = Qwen3CoderToolCallReader(TOOLS), [], 0

    def count_joins(frame, event, arg) -> None:
        nonlocal joins
        joins += event == "c_call" and getattr(arg, "__name__", "") == "join"

    sys.setprofile(count_joins)
    try:
        for i in range(0, len(text), 3):
            out += reader.pieces(text[i:i + 3])
        out += reader.pieces("", final=True)
    finally:
        sys.setprofile(None)
    assert joins <= 4  # (the two JSON values once each, and the first two pieces of the note)
    arguments = "".join(p.function.arguments for p in out if not isinstance(p, CallEnd))
    assert json.loads(arguments) == {"tags": ["ab"] * 3000, "note": note, "extra": ["ab"] * 3000}


@pytest.mark.parametrize("parameter, written, arguments", [
    ("ratio", "1e999", "1e999"), ("ratio", "-1.0000000000000000001E-2", "-1.0000000000000000001E-2"),
    ("days", "9" * 5000, "9" * 5000), ("days", "2.0", "2.0"), ("days", "2.5", '"2.5"'),  # (2.0 is an integer)
    ("tags", '[1e999, "a"]', '[1e999, "a"]'), ("extra", "1e999", "1e999"), ("ratio", "Infinity", '"Infinity"'),
])
def test_json_values_go_out_as_written(parameter, written, arguments):
    """A JSON value is its text as written, whatever Python would make of it (1e999 is inf, which no JSON holds;
    5000 digits are past its limit); text that is not JSON of the schema's type is the string."""
    assert read([call("forecast", (parameter, written))])[1] == [("forecast", f'{{"{parameter}": {arguments}}}')]


def test_a_recursive_schema_is_written_as_json(backend):
    """A $ref that comes back to itself is not strings only (looking for its strings would not end)."""
    tools = [ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}, "y": {"$ref": "#/$defs/B"}},
        "$defs": {"A": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/A"}]},
                  "B": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/C"}]},
                  "C": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/B"}]}}}}})]
    required = qwen3_coder_constraint(tools, "required", False)
    text = call("f", ("x", '"a"'), ("y", "null"))
    assert accepts(backend, required, text) and not accepts(backend, required, call("f", ("x", "a")))
    assert read([text], tools)[1] == [("f", '{"x": "a", "y": null}')]


@pytest.mark.parametrize("nothing", [{"anyOf": []}, {"enum": []}, {"oneOf": []}, False])
def test_a_parameter_no_value_fits_is_left_out_or_refused(backend, nothing):
    """No value can be written for it: left out where optional (the grammar would not compile), a 400 naming it
    where required."""
    def tool(required: list[str]) -> ChatTool:
        return ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": nothing, "b": {"type": "integer"}}, "required": required}}})

    optional = qwen3_coder_constraint([tool([])], "required", False)
    assert accepts(backend, optional, call("f", ("b", "1"))) and not accepts(backend, optional, call("f", ("a", "1")))
    with pytest.raises(ValueError, match="required parameter 'a' cannot be written"):
        qwen3_coder_constraint([tool(["a"])], "required", False)


@pytest.fixture(scope="module")
def backend(tiny_model_factory):
    return llguidance_backend(tiny_model_factory("llama"))


def test_the_grammars_take_what_the_reader_reads(backend):
    time_call = call("get_time", ("tz", "UTC"))
    weather_call = call("forecast", ("city", "Oslo\n</tool_call>"), ("days", "3"), ("unit", "C"), ("note", "null"),
                        ("code", '"ab"'), ("tags", '["x"]'), ("extra", "anything at all"))
    auto = qwen3_coder_constraint(TOOLS, "auto", True)
    for text in (time_call, f"{time_call}\n{weather_call}", "It is noon.", "", "Checking.\n\n" + time_call,
                 call("anything"), call("anything", ("n", "[1]"), ("n", "x"))):
        assert accepts(backend, auto, text), text
    for text in (call("get_time", ("tz", "PST")), call("get_time"),  # not in the enum; a required one missing
                 call("forecast", ("days", "3"), ("city", "Oslo")),  # not in the schema's order
                 call("forecast", ("city", "a\n</parameter>b"), ("days", "3")),  # a raw value holding its end
                 call("forecast", ("city", "Oslo"), ("days", "9")), call("forecast", ("city", "Oslo"), ("days", '"3"')),
                 call("forecast", ("city", "Oslo"), ("days", "3"), ("code", "ab")),  # a bounded string unquoted
                 call("forecast", ("city", "Oslo"), ("days", "3"), ("other", "1")),  # additionalProperties false
                 call("launch"), f"{time_call} and then", f"{time_call}{time_call}"):
        assert not accepts(backend, auto, text), text
    formatted = qwen3_coder_constraint(TOOLS, "auto", True, {"type": "object", "properties": {
        "answer": {"type": "integer"}}, "required": ["answer"]})
    for text in ('{"answer": 1}', time_call, f"{time_call}\n{weather_call}"):  # a message in the format, or calls
        assert accepts(backend, formatted, text), text
    assert not accepts(backend, formatted, "It is noon.")
    named = qwen3_coder_constraint(TOOLS, NamedToolChoice(type="function", function=NamedFunction(name="get_time")),
                                   True)
    assert accepts(backend, named, time_call) and not accepts(backend, named, weather_call)
    assert not accepts(backend, named, f"{time_call}\n{time_call}")
    required = qwen3_coder_constraint(TOOLS, "required", False)
    assert accepts(backend, required, weather_call) and not accepts(backend, required, "It is noon.")
    assert not accepts(backend, required, f"{time_call}\n{weather_call}")


@pytest.mark.parametrize("parameters, problem", [
    ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "anyOf"),
    ({"type": "object", "properties": {"a>b": {"type": "string"}}, "required": ["a>b"]}, "'a>b'"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a'"),
    ({"type": "array"}, "not an object"),
    ({"type": ["array", "null"]}, "not an object"),
])
def test_schemas_the_format_cannot_write_are_refused(parameters, problem):
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": parameters}})
    with pytest.raises(ValueError, match=r"^tools: .*'f'.*" + problem):
        qwen3_coder_constraint([tool], "required", False)


def test_every_output_of_the_grammars_reads_as_valid_calls(backend):
    """Random walks through the grammars: what they write reads back as calls of the tools, valid by jsonschema."""
    tokenizer = backend[0]
    texts = ["\n</parameter>\n", "</function>\n</tool_call>", "\n<tool_call>", "<tool_call>", "null", "Paris", "3",
             "-2.5e3", '"ab"', "[", "]", '"', "{", "}", ", ", "true", "\n", "C", "UTC"]
    texts += [f"<parameter={key}>\n" for key in list(FORECAST["properties"]) + ["other"]]
    chunks = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    rng = random.Random(0)
    read_calls = 0
    for choice in ("required", "auto", NamedToolChoice(type="function", function=NamedFunction(name="forecast"))):
        params = qwen3_coder_constraint(TOOLS, choice, True)
        for _ in range(60):
            ids = random_output(backend, params, rng, chunks)
            if ids is None:
                continue
            text = tokenizer.decode(ids)
            content, calls, _ = read([text])
            assert calls or (choice == "auto" and "<tool_call>" not in text), text
            for name, arguments in calls:
                schema = TOOL_SCHEMAS[name] or {"type": "object"}
                jsonschema.validate(json.loads(arguments), schema)
            read_calls += len(calls)
    assert read_calls >= 30  # (the walks do reach the ends of calls)


QWEN3_CODER_STYLE_TEMPLATE = """{%- if tools %}{{ '<|im_start|>system\nCall a function in a <tool_call> block:\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}
{%- for message in messages %}{{ '<|im_start|>' + message.role }}
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}{{ '\n<tool_call>\n<function=' + tool_call.function.name + '>\n' }}
{%- for key, value in tool_call.function.arguments.items() %}{{ '<parameter=' + key + '>\n' }}
{{- value if value is string else value | tojson }}{{ '\n</parameter>\n' }}{% endfor %}
{{- '</function>\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
SERVER_TOOLS = [  # bounded values: the random model ends them
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}}]
NOTE_TOOL = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
SAMPLING = {**SAMPLING, "max_tokens": 150}


def test_the_template_renders_calls_the_reader_reads(tiny_model_factory):
    """The history's calls as the template renders them (a string raw, None as null, others as JSON) read back."""
    from folio.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_factory("llama"))
    arguments = {"city": "Paris\nFrance", "days": 3, "unit": "C", "note": None, "tags": ["a"], "extra": {"k": [1]}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "forecast", "arguments": json.dumps(arguments)}}]}]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=False, tools=[t.model_dump() for t in TOOLS],
                                         chat_template=QWEN3_CODER_STYLE_TEMPLATE)
    answer = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")  # (as the model writes it)
    assert read([answer])[:2] == ("", [("forecast", json.dumps(arguments))])


server = tool_server_fixture("qwen3_coder", QWEN3_CODER_STYLE_TEMPLATE, arch="qwen3_moe")


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=SERVER_TOOLS, tool_choice="required", seed=seed, parallel_tool_calls=False,
                  **SAMPLING)
    assert_calls_stream_as_plain(client, **kwargs)


def test_a_raw_string_streams_as_it_comes_even_cut_off(client):
    """The random model does not end a free string: max_tokens cuts the call, whose text so far is the value."""
    kwargs = dict(messages=MESSAGES, tools=[NOTE_TOOL], tool_choice="required", seed=4,
                  **{**SAMPLING, "max_tokens": 60})
    plain = client.chat.completions.create(**kwargs)
    (tool_call,) = plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "length" and tool_call.function.name == "note"
    assert list(json.loads(tool_call.function.arguments)) == ["text"]  # (the value so far)
    assert streamed(client, **kwargs)[1] == [("note", tool_call.function.arguments)]


def test_a_named_function_and_auto(client):
    assert_named_call(client, "get_time", messages=MESSAGES, tools=SERVER_TOOLS, seed=3, parallel_tool_calls=False,
                      **SAMPLING)
    for seed in range(3):
        auto = client.chat.completions.create(messages=MESSAGES, tools=SERVER_TOOLS, seed=seed,
                                              **{**SAMPLING, "max_tokens": 8})
        choice = auto.choices[0]
        assert not choice.message.tool_calls and choice.message.content  # the random model's text is content


def test_a_schema_the_format_cannot_write_is_a_400(client):
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": 1}}}
    with pytest.raises(openai.BadRequestError, match="minProperties"):
        client.chat.completions.create(messages=MESSAGES, tools=[tool], tool_choice="required", **SAMPLING)


def test_responses_give_function_call_items(client):
    assert_responses_call(client, SERVER_TOOLS, max_output_tokens=150)
