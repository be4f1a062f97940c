"""Llama 3's JSON tool calls (`--tool-call-parser llama3_json`): the reader on any split of the text, and through the
server with a Llama-3-style template: tool_choice's grammars make the tiny random model write calls that the
reader gives back as tool_calls (chat, streamed and not) and function_call items (responses); an answer that is
not calls is content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.tool_llama3_json import Llama3JsonToolCallReader
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, assert_calls_stream_as_plain, assert_named_call,
                                 assert_responses_call, cut, llguidance_backend, read_pieces, tool_server_fixture)
from tool_format_fixture import client  # noqa: F401 (a fixture)

NAMES = ["get_time", "get_weather"]


def read(pieces: list[str], names=NAMES) -> tuple[str, list[tuple[str, dict]], list]:
    """The content and the calls (name, arguments) a choice's pieces give, and every piece read."""
    content, calls, out = read_pieces(Llama3JsonToolCallReader(names), pieces)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls], out


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_time", "parameters": {"tz": "UTC"}}', "", [("get_time", {"tz": "UTC"})]),
    ('{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_weather", "arguments": {"city": "Oslo"}}; ',
     "", [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]),  # "arguments" is read too
    (' {"name": "get_time", "parameters": {}}', ' {"name": "get_time", "parameters": {}}', []),  # not its start
    ('{"name": "get_time", "parameters": {"tz": "a\\"}"}}', "", [("get_time", {"tz": 'a"}'})]),  # a brace in a string
    ('{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}',
     '{"name": "get_time", "parameters": {}}', [("get_time", {})]),  # no ";" between them
    ("It is noon.", "It is noon.", []),
    ('{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),  # not one of the tools
    ('{"name": "get_time", "parameters": "UTC"}', '{"name": "get_time", "parameters": "UTC"}', []),
    ('{"name": "get_time", "parameters": {"tz": "U', '{"name": "get_time", "parameters": {"tz": "U', []),  # cut off
    ('{"name": "get_time", "parameters": {}} and then', "and then", [("get_time", {})]),
    ("", "", []),
])
def test_reads(text, content, calls):
    assert read([text])[:2] == (content, calls)


BITS = st.sampled_from(['{"name": "get_time", "parameters": {"tz": "UTC"}}', '{"name": "get_weather", ',
                        '"parameters": {"city": "a}b"}}', "; ", " ", "\n", "{", "}", "text", '"'])


@settings(max_examples=300, deadline=None)
@given(st.lists(BITS, max_size=8), st.lists(st.integers(0, 200), max_size=5))
def test_any_pieces_read_as_the_whole(bits, cuts):
    text = "".join(bits)
    pieces = cut(text, cuts)
    assert read(pieces)[:2] == read([text])[:2]


def test_every_tool_call_parser_flag_has_its_format():
    from folio.entrypoints.openai.server_options import TOOL_CALL_PARSERS
    from folio.entrypoints.openai.tool_call_format import TOOL_CALL_FORMATS

    assert tuple(TOOL_CALL_FORMATS) == TOOL_CALL_PARSERS


def test_calls_go_out_as_each_completes():
    parser = Llama3JsonToolCallReader(NAMES)
    assert parser.pieces('{"name": "get_time", "parameters": {"tz": ') == []
    first = parser.pieces('"UTC"}}; {"name": "get_weather"')
    assert [type(p).__name__ for p in first] == ["DeltaToolCall", "CallEnd"] and first[0].function.name == "get_time"
    assert parser.pieces("plain", final=False) == [] and parser.pieces("", final=True) == \
        ['{"name": "get_weather"plain']  # a call cut off is content


@pytest.fixture(scope="module")
def backend(llama_dir):
    return llguidance_backend(llama_dir)


def test_the_grammars_take_what_the_reader_reads(backend):
    from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
    from folio.entrypoints.openai.tool_llama3_json import llama3_json_constraint

    tools = [ChatTool.model_validate(tool) for tool in TOOLS]
    time_call = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    weather_call = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
    auto = llama3_json_constraint(tools, "auto", True)
    for text in (time_call, f"{time_call}; {weather_call}", "It is noon.", "", " {"):
        assert accepts(backend, auto, text), text
    for text in ('{"name": "get_time", "parameters": {"tz": "PST"}}', '{"answer": 1}', f"{time_call};"):
        assert not accepts(backend, auto, text), text
    formatted = llama3_json_constraint(tools, "auto", True, {"type": "object", "properties": {"answer": {
        "type": "integer"}}, "required": ["answer"]})
    for text in ('{"answer": 1}', time_call, f"{time_call}; {weather_call}"):  # a message in the format, or calls
        assert accepts(backend, formatted, text), text
    assert not accepts(backend, formatted, "It is noon.")
    named = llama3_json_constraint(tools, NamedToolChoice(type="function", function=NamedFunction(name="get_time")),
                                   True)
    assert accepts(backend, named, time_call) and not accepts(backend, named, weather_call)
    assert not accepts(backend, named, f"{time_call}; {time_call}")
    required = llama3_json_constraint(tools, "required", False)
    assert accepts(backend, required, weather_call) and not accepts(backend, required, "It is noon.")
    assert not accepts(backend, required, f"{time_call}; {weather_call}")
    defs = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"tz": {"$ref": "#/$defs/Zone"}}, "required": ["tz"],
        "$defs": {"Zone": {"enum": ["UTC"]}}}}})  # the function's $refs still resolve
    assert accepts(backend, llama3_json_constraint([defs], "required", False),
                   '{"name": "f", "parameters": {"tz": "UTC"}}')


def test_the_parameters_are_an_object_whatever_the_schema_says(backend):
    """A schema without "type": "object" takes any JSON value: the grammar still writes an object, which the
    reader reads; a schema whose type is not an object's is refused."""
    from folio.entrypoints.openai.protocol import ChatTool
    from folio.entrypoints.openai.tool_llama3_json import llama3_json_constraint

    untyped = ChatTool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
        "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}})
    required = llama3_json_constraint([untyped], "required", False)
    assert accepts(backend, required, '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert not accepts(backend, required, '{"name": "get_time", "parameters": "UTC"}')
    array = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}})
    with pytest.raises(ValueError, match="'f' are of type 'array', not an object"):
        llama3_json_constraint([array], "required", False)


def test_parameters_go_out_as_written():
    """Numbers Python would change (1e999 to inf, which no JSON holds) or could not read (5000 digits) are the
    model's: the arguments are the parameters' JSON text as written."""
    parameters = '{"n": 1e999, "m": 1.0000000000000000001, "i": ' + "9" * 5000 + "}"
    text = '{"name": "get_time", "parameters": ' + parameters + "}"
    content, (tool_call,), _ = read_pieces(Llama3JsonToolCallReader(NAMES), cut(text, [3, 40, 1000]))
    assert content == "" and tool_call.function.arguments == parameters


LLAMA_STYLE_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'user' and tools %}Call a function by answering with {"name": ..., "parameters": ...}:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}
{%- if message.tool_calls %}{% for call in message.tool_calls %}{% if not loop.first %}; {% endif %}
{{- {"name": call.function.name, "parameters": call.function.arguments} | tojson }}{% endfor %}
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


server = tool_server_fixture("llama3_json", LLAMA_STYLE_TEMPLATE)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed, parallel_tool_calls=False,
                  **{**SAMPLING, "max_tokens": 250})
    assert_calls_stream_as_plain(client, **kwargs)


def test_a_named_function_and_auto(client):
    assert_named_call(client, "get_time", messages=MESSAGES, tools=TOOLS, seed=3, parallel_tool_calls=False, **SAMPLING)
    for seed in range(4):
        auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=seed,
                                              **{**SAMPLING, "max_tokens": 8})
        choice = auto.choices[0]
        # text that does not start with "{" is content; a call's start is cut off by max_tokens, and is content too
        assert not choice.message.tool_calls and (choice.finish_reason == "length" or not choice.message.content
                                                  or not choice.message.content.startswith("{"))


def test_responses_give_function_call_items(client):
    assert_responses_call(client, TOOLS, max_output_tokens=120)
