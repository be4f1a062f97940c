"""GLM-4.5's tool calls (`--tool-call-parser glm45`) and reasoning (`--reasoning-parser glm45`): the reader on any split
of the text and by the functions' schemas; the grammars, whose every output (random walks through them) reads back
as calls valid by the schemas; and the server with a GLM-4.5-style template on the tiny GLM-4 model: tool_choice's
grammars make it write calls that come back as tool_calls (chat, streamed and not) and function_call items
(responses)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
from folio.entrypoints.openai.tool_glm45 import Glm45ToolCallReader, glm45_constraint
from folio.entrypoints.openai.tool_parser import CallEnd
from folio.reasoning_parser import REASONING_PARSERS, ReasoningSplitter
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, assert_calls_stream_as_plain, assert_named_call,
                                 assert_responses_call, cut, llguidance_backend, random_output, read_pieces,
                                 tool_server_fixture)
from tool_format_fixture import client  # noqa: F401 (a fixture)

FORECAST = {"type": "object", "properties": {
    "city": {"type": "string"},  # raw
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]},  # raw choices
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # Optional[str]: raw, "null" None
    "code": {"type": "string", "maxLength": 4},  # a bounded string: JSON-quoted
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["city", "days"], "additionalProperties": False}
TOOL_SCHEMAS = {"forecast": FORECAST,
                "get_time": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
                "anything": None}
TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": schema}})
         for name, schema in TOOL_SCHEMAS.items()]


def read(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]], list]:
    """The content and the calls (name, arguments' JSON text) a choice's pieces give, and every piece read."""
    content, calls, out = read_pieces(Glm45ToolCallReader(tools), pieces)
    return content, [(c.function.name, c.function.arguments) for c in calls], out


def call(name: str, *arguments: tuple[str, str], newlines: bool = True) -> str:
    """A call as GLM-4.5 writes it (values as given: raw or JSON text); without the newlines, as GLM-4.7 does."""
    nl = "\n" if newlines else ""
    written = "".join(f"<arg_key>{key}</arg_key>{nl}<arg_value>{value}</arg_value>{nl}" for key, value in arguments)
    return f"<tool_call>{name}{nl}{written}</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    (call("forecast", ("city", "Paris"), ("days", "3")), "", [("forecast", {"city": "Paris", "days": 3})]),
    (call("forecast", ("city", "3"), ("days", " 3 ")), "",  # by the schema: "3" a string, 3 a number
     [("forecast", {"city": "3", "days": 3})]),
    (call("forecast", ("city", "Paris"), ("days", "3"), newlines=False), "",  # GLM-4.7's layout
     [("forecast", {"city": "Paris", "days": 3})]),
    ("Let me look.\n" + call("get_time", ("tz", "UTC")) + "\n" + call("get_time", ("tz", "CET")) + "\nDone.",
     "Let me look.\nDone.", [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]),
    (call("forecast", ("city", " two\nlines </tool_call> <arg_key>"), ("days", "1")), "",  # a raw string: as is
     [("forecast", {"city": " two\nlines </tool_call> <arg_key>", "days": 1})]),
    (call("forecast", ("city", ""), ("note", "null"), ("unit", "F")), "",
     [("forecast", {"city": "", "note": None, "unit": "F"})]),
    (call("forecast", ("code", '"ab\\"c"'), ("tags", '["a", "b"]'), ("days", "many")), "",  # not JSON of its type:
     [("forecast", {"code": 'ab"c', "tags": ["a", "b"], "days": "many"})]),  # the text
    (call("forecast", (" city ", "x"), ("city", "y")), "", [("forecast", {"city": "x"})]),  # keys stripped; first kept
    (call("anything", ("n", "1"), ("s", "word")), "", [("anything", {"n": 1, "s": "word"})]),
    (call("get_time"), "", [("get_time", {})]),
    (call("launch", ("x", "1")), call("launch", ("x", "1")), []),  # not one of the tools
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),  # Hermes' call
    ("<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n<oops>\n</tool_call> after", "after",
     [("get_time", {"tz": "UTC"})]),  # broken after its name: skipped to </tool_call>
    ("<tool_call>forecast\n<arg_key>city</arg_key> x <arg_value>Oslo</arg_value></tool_call>", "",
     [("forecast", {})]),  # text between a key and its value
    ("<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>Par", "", [("forecast", {"city": "Par"})]),  # cut off
    ("<tool_call>forec", "<tool_call>forec", []),  # cut before its name is known
    ("It is noon.", "It is noon.", []),
    ("", "", []),
])
def test_reads(text, content, calls):
    got_content, got_calls, _ = read([text])
    assert (got_content, [(name, json.loads(arguments)) for name, arguments in got_calls]) == (content, calls)


BITS = st.sampled_from([call("forecast", ("city", "Oslo"), ("days", "2")), "<tool_call>", "forecast\n", "get_time",
                        "<arg_key>", "city", "note", "days", "</arg_key>", "<arg_value>", "</arg_value>",
                        "</tool_call>", "null", "\n", " ", "text", "4", '"x"', "<", ">", "</"])


@settings(max_examples=300, deadline=None)
@given(st.lists(BITS, max_size=12), st.lists(st.integers(0, 300), max_size=6))
def test_any_pieces_read_as_the_whole(bits, cuts):
    text = "".join(bits)
    whole = read([text])
    assert read(cut(text, cuts))[:2] == whole[:2]
    for _, arguments in whole[1]:
        assert isinstance(json.loads(arguments), dict)  # the arguments are JSON whatever the text


def test_a_call_streams_as_it_comes():
    reader = Glm45ToolCallReader(TOOLS)
    (opening,) = reader.pieces("<tool_call>forecast\n<arg_key>note</arg_key>\n<arg_value>nu")
    assert opening.function.name == "forecast" and opening.id and opening.function.arguments == ""
    assert reader.pieces("l") == []  # still maybe null
    assert [p.function.arguments for p in reader.pieces("lx</arg_")] == ['{"note": "nullx']  # a string, streamed
    assert [p.function.arguments for p in reader.pieces("value>\n<arg_key>days</arg_key>\n<arg_value>")] == ['"']
    assert [p.function.arguments for p in reader.pieces("5</arg_value>\n")] == [', "days": 5']
    end = reader.pieces("</tool_call>")
    assert end[0].function.arguments == "}" and end[1] == CallEnd(0)


@pytest.fixture(scope="module")
def backend(tiny_model_factory):
    return llguidance_backend(tiny_model_factory("llama"))


def test_the_grammars_take_what_the_reader_reads(backend):
    time_call = call("get_time", ("tz", "UTC"))
    weather_call = call("forecast", ("city", "Oslo\n</tool_call>"), ("days", "3"), ("unit", "C"), ("note", "null"),
                        ("code", '"ab"'), ("tags", '["x"]'))
    auto = glm45_constraint(TOOLS, "auto", True)
    for text in (time_call, f"{time_call}\n{weather_call}", "It is noon.", "", "Checking.\n\n" + time_call,
                 call("anything"), call("anything", ("n", "[1]"), ("n", "x"))):
        assert accepts(backend, auto, text), text
    for text in (call("get_time", ("tz", "PST")), call("get_time"),  # not in the enum; a required one missing
                 call("forecast", ("days", "3"), ("city", "Oslo")),  # not in the schema's order
                 call("forecast", ("city", "a</arg_value>b"), ("days", "3")),  # a raw value holding its end
                 call("forecast", ("city", "Oslo"), ("days", "9")), call("forecast", ("city", "Oslo"), ("days", '"3"')),
                 call("forecast", ("city", "Oslo"), ("days", "3"), ("code", "ab")),  # a bounded string unquoted
                 call("forecast", ("city", "Oslo"), ("days", "3"), ("other", "1")),  # additionalProperties false
                 call("launch"), f"{time_call} and then", f"{time_call}{time_call}"):
        assert not accepts(backend, auto, text), text
    formatted = glm45_constraint(TOOLS, "auto", True, {"type": "object", "properties": {
        "answer": {"type": "integer"}}, "required": ["answer"]})
    for text in ('{"answer": 1}', time_call, f"{time_call}\n{weather_call}"):  # a message in the format, or calls
        assert accepts(backend, formatted, text), text
    assert not accepts(backend, formatted, "It is noon.")
    named = glm45_constraint(TOOLS, NamedToolChoice(type="function", function=NamedFunction(name="get_time")), True)
    assert accepts(backend, named, time_call) and not accepts(backend, named, weather_call)
    assert not accepts(backend, named, f"{time_call}\n{time_call}")
    required = glm45_constraint(TOOLS, "required", False)
    assert accepts(backend, required, weather_call) and not accepts(backend, required, "It is noon.")
    assert not accepts(backend, required, f"{time_call}\n{weather_call}")


@pytest.mark.parametrize("parameters, problem", [
    ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "anyOf"),
    ({"type": "object", "properties": {" a": {"type": "string"}}, "required": [" a"]}, "' a'"),
    ({"type": "object", "properties": {"a": {"enum": ["x</arg_value>"]}}}, "'a'"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a'"),
    ({"type": "array"}, "not an object"),
])
def test_schemas_the_format_cannot_write_are_refused(parameters, problem):
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": parameters}})
    with pytest.raises(ValueError, match=r"^tools: .*'f'.*" + problem):
        glm45_constraint([tool], "required", False)


def test_a_parameter_named_with_spaces_is_left_out_where_optional(backend):
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {" a": {"type": "integer"}, "b": {"type": "integer"}}}}})
    required = glm45_constraint([tool], "required", False)
    assert accepts(backend, required, call("f", ("b", "1"))) and not accepts(backend, required, call("f", (" a", "1")))


def test_every_output_of_the_grammars_reads_as_valid_calls(backend):
    """Random walks through the grammars: what they write reads back as calls of the tools, valid by jsonschema."""
    tokenizer = backend[0]
    texts = ["</arg_value>\n", "</tool_call>", "\n<tool_call>", "<tool_call>", "null", "Paris", "3", "-2.5e3", '"ab"',
             "[", "]", '"', "{", "}", ", ", "true", "\n", "C", "UTC"]
    texts += [f"<arg_key>{key}</arg_key>\n<arg_value>" for key in list(FORECAST["properties"]) + ["other"]]
    chunks = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    rng, read_calls = random.Random(0), 0
    for choice in ("required", "auto", NamedToolChoice(type="function", function=NamedFunction(name="forecast"))):
        params = glm45_constraint(TOOLS, choice, True)
        for _ in range(60):
            ids = random_output(backend, params, rng, chunks)
            if ids is None:
                continue
            text = tokenizer.decode(ids)
            _, calls, _ = read([text])
            assert calls or (choice == "auto" and "<tool_call>" not in text), text
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name] or {"type": "object"})
            read_calls += len(calls)
    assert read_calls >= 30  # (the walks do reach the ends of calls)


def test_the_glm45_reasoning_parser_is_deepseek_r1_s():
    """vLLM's glm45 reads GLM-4.5's think block as its deepseek_r1 does (or the output as content, with thinking
    off: the prompt then closed the block, which starts_in_reasoning reads)."""
    assert replace(REASONING_PARSERS["glm45"], name="deepseek_r1") == REASONING_PARSERS["deepseek_r1"]
    output = "\n<think>The user wants weather.</think>\n" + call("get_time", ("tz", "UTC"))
    split = ReasoningSplitter(REASONING_PARSERS["glm45"], True).feed(output, final=True)
    assert split.reasoning == "The user wants weather."
    assert read([split.content])[:2] == ("", [("get_time", '{"tz": "UTC"}')])


# GLM-4.5's template on the tiny tokenizer's turn tokens: the tools as JSON lines, each call after a newline, a
# value raw where it is a string and its JSON otherwise
GLM45_STYLE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}{{ '\\n<tool_call>' + tc.function.name + '\\n' }}
{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>{{ '\\n' }}<arg_value>
{{- v | tojson if v is not string else v }}</arg_value>{{ '\\n' }}{% endfor %}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SERVER_TOOLS = [  # bounded values: the random model ends them
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}}]
SAMPLING = {**SAMPLING, "max_tokens": 250}


def test_the_template_renders_calls_the_reader_reads(tiny_model_factory):
    """The history's calls as the template renders them (a string raw, None as null, others as JSON) read back."""
    from folio.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_factory("llama"))
    arguments = {"city": "Paris\nFrance", "days": 3, "unit": "C", "note": None, "tags": ["a"]}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "forecast", "arguments": json.dumps(arguments)}}]}]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=False, tools=[t.model_dump() for t in TOOLS],
                                         chat_template=GLM45_STYLE_TEMPLATE)
    answer = text.rsplit("<|im_start|>assistant", 1)[1].removesuffix("<|im_end|>\n")  # (as the model writes it)
    assert answer.startswith("\n<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>Paris\nFrance</arg_value>")
    # (GLM-4.5 writes the newline after its think block, which the reasoning parser takes with the whitespace)
    assert read([answer])[:2] == ("\n", [("forecast", json.dumps(arguments))])


server = tool_server_fixture("glm45", GLM45_STYLE_TEMPLATE, arch="glm4")


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=SERVER_TOOLS, tool_choice="required", seed=seed, **SAMPLING)
    assert_calls_stream_as_plain(client, **kwargs)


def test_a_named_function_and_auto(client):
    assert_named_call(client, "get_time", messages=MESSAGES, tools=SERVER_TOOLS, seed=3, **SAMPLING)
    for seed in range(2):
        choice = client.chat.completions.create(messages=MESSAGES, tools=SERVER_TOOLS, seed=seed,
                                                **{**SAMPLING, "max_tokens": 8}).choices[0]
        assert not choice.message.tool_calls and choice.message.content  # the random model's text is content


def test_a_schema_the_format_cannot_write_is_a_400(client):
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": 1}}}
    with pytest.raises(openai.BadRequestError, match="glm45.*minProperties"):
        client.chat.completions.create(messages=MESSAGES, tools=[tool], tool_choice="required", **SAMPLING)


def test_responses_give_function_call_items(client):
    assert_responses_call(client, SERVER_TOOLS, max_output_tokens=250)
