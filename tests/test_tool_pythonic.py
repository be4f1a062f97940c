"""Pythonic tool calls (`--tool-call-parser pythonic`): the reader on any split of the text, the grammars against
what the reader reads back (every output a random walk through a grammar takes is read as calls whose arguments
validate against their schema), and through the server with a pythonic template: tool_choice's grammars make the
tiny random model write calls that the reader gives back as tool_calls (chat, streamed and not) and function_call
items (responses); an answer that is not calls is content."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
from folio.entrypoints.openai.tool_pythonic import PythonicToolCallReader, pythonic_constraint
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, assert_calls_stream_as_plain, assert_named_call,
                                 assert_responses_call, cut, llguidance_backend, read_pieces, tool_server_fixture)
from tool_format_fixture import client  # noqa: F401 (a fixture)

NAMES = ["get_time", "get_weather"]


def read(pieces: list[str], names=NAMES) -> tuple[str, list[tuple[str, dict]], list]:
    """The content and the calls (name, arguments) a choice's pieces give, and every piece read."""
    content, calls, out = read_pieces(PythonicToolCallReader(names), pieces)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls], out


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris", days=3), get_time(tz=\'UTC\', dst=True, offset=None)]', "",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC", "dst": True, "offset": None})]),
    ('[get_time(a=[1, -2.5, "x]"], b={"k": [True, None]}, c={"j": [true, false, null]})]', "",
     [("get_time", {"a": [1, -2.5, "x]"], "b": {"k": [True, None]}, "c": {"j": [True, False, None]}})]),
    ("[get_time(tz='a\\'b\\n\\u00e9')]", "", [("get_time", {"tz": "a'b\né"})]),  # Python's escapes
    (' \n[ get_time( ) ]\n', "", [("get_time", {})]),  # spaces before, inside and after
    ("<|python_start|>[get_time()]<|python_end|>", "", [("get_time", {})]),  # Llama 4's wrappers
    ("[get_time()] It is noon.", "It is noon.", [("get_time", {})]),  # text after the list
    ("[get_time()] <|python_e", "<|python_e", [("get_time", {})]),
    ("It is noon.", "It is noon.", []),
    ("<|python_start|>It is noon.", "<|python_start|>It is noon.", []),
    ("  ", "  ", []),
    ("", "", []),
    ("[1] is a reference", "[1] is a reference", []),
    ("[]", "[]", []),
    ("[launch()]", "[launch()]", []),  # not one of the tools
    ("[get_time(), launch()]", "[get_time(), launch()]", []),  # all calls or none
    ("[get_time('UTC')]", "[get_time('UTC')]", []),  # a positional argument
    ("[get_time(tz=now())]", "[get_time(tz=now())]", []),  # not a literal
    ("[get_time(x=1_0e999)]", "[get_time(x=1_0e999)]", []),  # not JSON's, and inf
    ("[get_time(x={1: 2})]", "[get_time(x={1: 2})]", []),  # a key that is not a string
    ("[get_time(**{'a': 1})]", "[get_time(**{'a': 1})]", []),
    ("[get_time(a=1, a=2)]", "[get_time(a=1, a=2)]", []),
    ("[get_time(tz='UTC'", "[get_time(tz='UTC'", []),  # cut off
    ("[get_time()][get_time()]", "[get_time()]", [("get_time", {})]),
])
def test_reads(text, content, calls):
    assert read([text])[:2] == (content, calls)


def test_any_function_without_names():
    assert read(["[launch(at=1)]"], names=None)[1] == [("launch", {"at": 1})]


BITS = st.sampled_from(['[get_time(tz="UTC")', "[get_weather(", 'city="a]b", ', "days=[1, {'x': (2)}]", ")", "]",
                        ", ", " ", "\n", "[", "'", '"', "\\", "text", "<|python_start|>", "<|python_", "end|>",
                        "get_time(", "True"])


@settings(max_examples=300, deadline=None)
@given(st.lists(BITS, max_size=8), st.lists(st.integers(0, 200), max_size=5))
def test_any_pieces_read_as_the_whole(bits, cuts):
    text = "".join(bits)
    pieces = cut(text, cuts)
    assert read(pieces)[:2] == read([text])[:2]


def test_an_escape_split_between_pieces():
    text = '[get_time(tz="a\\"]", zone=\'b\\\']\')]'
    assert read([text])[1] == [("get_time", {"tz": 'a"]', "zone": "b']"})]
    for at in range(len(text) + 1):
        assert read([text[:at], text[at:]])[:2] == read([text])[:2], at


def test_numbers_go_out_as_written():
    """A number is its text where that is JSON's, whatever Python would make of it (1e999 is inf, which no JSON
    holds; 1.0000000000000000001 is 1.0), its value where it is only Python's (0x10, 1_000, 1.)."""
    big = "9" * 4000
    text = (f"[get_time(n=1e999, m=-1.0000000000000000001E-2, h=0x10, u=1_000, f=1., p=+2, i={big}, "
            "a=[2.50, {'k': -0e0}, true], s='\\u00e9')]")
    content, (tool_call,), _ = read_pieces(PythonicToolCallReader(NAMES), [text])
    assert content == "" and tool_call.function.arguments == (
        f'{{"n": 1e999, "m": -1.0000000000000000001E-2, "h": 16, "u": 1000, "f": 1.0, "p": 2, "i": {big}, '
        '"a": [2.50, {"k": -0e0}, true], "s": "\u00e9"}')


def test_text_goes_out_once_it_cannot_be_calls():
    parser = PythonicToolCallReader(NAMES)
    assert parser.pieces(" [get_ti") == [] and parser.pieces("me(tz=") == []  # may be a call: held
    parser = PythonicToolCallReader(NAMES)
    assert parser.pieces(" [see ") == [] and parser.pieces("below") == [" [see below"]  # a name, then no "("
    parser = PythonicToolCallReader(NAMES)
    assert parser.pieces("[launch(") == ["[launch("] and parser.pieces("x") == ["x"]  # not a function's
    parser = PythonicToolCallReader(NAMES)
    assert parser.pieces("[get_time(tz='UTC'), get_weather(") == []
    calls = parser.pieces("city='Oslo')] ")  # all calls at once, when the list closes
    assert [type(p).__name__ for p in calls] == ["DeltaToolCall", "CallEnd"] * 2


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}, "dst": {"type": "boolean"},
                                         "offset": {"anyOf": [{"type": "integer", "minimum": -12, "maximum": 12},
                                                              {"type": "null"}]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
# Every kind of value the grammar writes: Python's booleans and None, enums and consts of them, type lists, $refs,
# containers in JSON (true/false/null inside), strings with escapes.
EVERYTHING = {"type": "object", "properties": {
    "flag": {"type": "boolean"}, "nothing": {"type": "null"}, "level": {"type": ["integer", "null"], "maximum": 9,
                                                                         "minimum": -9},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1}, "mode": {"enum": ["a\"b", 1.5, True, None]},
    "same": {"const": False}, "note": {"type": "string", "maxLength": 4, "description": "a short note"},
    "tags": {"type": "array", "items": {"type": ["boolean", "null", "string"], "maxLength": 2}, "maxItems": 3},
    "opts": {"type": "object", "properties": {"on": {"type": "boolean"}, "off": {"type": "null"}},
             "additionalProperties": False},
    "zone": {"$ref": "#/$defs/Zone"}, "maybe": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "boolean"}]}},
    "required": ["flag", "zone"], "additionalProperties": False, "$defs": {"Zone": {"enum": ["UTC", False]}}}
ALL_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "everything", "parameters": EVERYTHING}}]


@pytest.fixture(scope="module")
def backend(llama_dir):
    return llguidance_backend(llama_dir)


def _tools(tools=TOOLS) -> list[ChatTool]:
    return [ChatTool.model_validate(tool) for tool in tools]


def test_the_grammars_take_what_the_reader_reads(backend):
    tools = _tools()
    time_call = 'get_time(tz="UTC", dst=True, offset=-3)'
    weather_call = 'get_weather(city="Oslo", unit="C")'
    auto = pythonic_constraint(tools, "auto", True)
    for text in (f"[{time_call}]", f"[{time_call}, {weather_call}]", '[get_time(tz="CET", offset=None)]',
                 "It is noon.", "", " ", "a [b", "<|python_start|> hi"):
        assert accepts(backend, auto, text), text
    for text in ('[get_time(tz="PST")]', '[get_time(tz="UTC", dst=true)]', "[get_time()]",  # PST, true, no tz
                 '[get_time(dst=True, tz="UTC")]', '[get_weather(unit="C", city="Oslo")]',  # not the schema's order
                 '[get_weather(city="Oslo", unit="C", extra=1)]', f"[{time_call},{weather_call}]",
                 " [x", "[1] is a reference", "<|python_start|>[", f"[{time_call}] and then"):
        assert not accepts(backend, auto, text), text
    formatted = pythonic_constraint(tools, "auto", True, {"type": "object", "properties": {"answer": {
        "type": "integer"}}, "required": ["answer"]})
    for text in ('{"answer": 1}', f"[{time_call}]", f"[{time_call}, {weather_call}]"):
        assert accepts(backend, formatted, text), text
    assert not accepts(backend, formatted, "It is noon.")
    named = pythonic_constraint(tools, NamedToolChoice(type="function", function=NamedFunction(name="get_time")),
                                True)
    assert accepts(backend, named, f"[{time_call}]") and not accepts(backend, named, f"[{weather_call}]")
    assert not accepts(backend, named, f"[{time_call}, {time_call}]")
    required = pythonic_constraint(tools, "required", False)
    assert accepts(backend, required, f"[{weather_call}]") and not accepts(backend, required, "It is noon.")
    assert not accepts(backend, required, f"[{time_call}, {weather_call}]")
    assert pythonic_constraint(tools, "none", True) is None


@pytest.mark.parametrize("tool, refused", [
    ({"name": "get-time"}, "Python names"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"from": {"type": "string"}},
                                  "required": ["from"]}}, "'from'"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"x": False}, "required": ["x"]}}, "'x'"),
    ({"name": "f", "parameters": {"type": "object", "minProperties": 1}}, "minProperties"),
    ({"name": "f", "parameters": {"type": "array"}}, "not an object"),
    ({"name": "f", "parameters": {"type": "object", "required": ["a"], "additionalProperties": False}}, "'a'"),
])
def test_tools_it_cannot_write_are_refused(tool, refused):
    with pytest.raises(ValueError, match=refused):
        pythonic_constraint(_tools([{"type": "function", "function": tool}]), "auto", True)


def test_optional_properties_python_cannot_name_are_left_out(backend):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"from": {"type": "string"}, "x-y": {"type": "string"}, "x": False,
                                         "to": {"type": "string"}}}}}
    required = pythonic_constraint(_tools([tool]), "required", False)
    assert accepts(backend, required, '[f(to="a")]') and accepts(backend, required, "[f()]")
    assert not accepts(backend, required, '[f(x="a")]')


def test_a_required_name_properties_leave_out_takes_additional_properties(backend):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}}}
    required = pythonic_constraint(_tools([tool]), "required", False)
    assert accepts(backend, required, "[f(a=1)]") and not accepts(backend, required, '[f(a="x")]')


def test_a_recursive_schema_compiles(backend):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/A"}]}}}}}
    required = pythonic_constraint(_tools([tool]), "required", False)
    assert accepts(backend, required, '[f(x="a")]') and not accepts(backend, required, "[f(x=1)]")


def test_numbers_python_cannot_hold_are_calls(backend):
    """The grammar writes JSON's numbers, 1e999 too, which go out as written (Python's would be inf)."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}}}
    text = "[get_time(n=1e999)]"
    assert accepts(backend, pythonic_constraint(_tools([tool]), "required", False), text)
    assert read_pieces(PythonicToolCallReader(NAMES), [text])[1][0].function.arguments == '{"n": 1e999}'


def _walk(grammar, tokenizer, rng: random.Random, start: str = "", limit: int = 400) -> str | None:
    """The text of a random path through a grammar from `start` to its end (EOS taken half the times it is
    allowed), or None where it did not end within `limit` tokens."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(1, 512)
    tokens = tokenizer.encode(start, add_special_tokens=False)
    assert grammar.accept_tokens(tokens)
    for _ in range(limit):
        fill_next_token_bitmask(grammar.matcher, bitmask, 0)
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:512])
        if 2 in allowed and (rng.random() < 0.5 or len(allowed) == 1):
            return tokenizer.decode(tokens)
        token = int(rng.choice([t for t in allowed if t != 2]))
        assert grammar.accept_tokens([token])
        tokens.append(token)
    return None


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_whatever_the_grammar_writes_reads_back_as_valid_calls(backend, tool_choice):
    tokenizer, grammar_backend = backend
    params = pythonic_constraint(_tools(ALL_TOOLS), tool_choice, True)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in ALL_TOOLS}
    rng, ended, called = random.Random(0), 0, 0
    for i in range(60):
        text = _walk(grammar_backend.compile(params), tokenizer, rng, "[" if i % 2 else "")  # ("auto": calls too)
        if text is None:
            continue
        ended += 1
        content, calls, _ = read([text], names=list(schemas))
        if text.lstrip().startswith("["):  # the grammar writes a list only as calls
            assert content == "" and calls, text
            called += 1
        else:
            assert content == text and not calls
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])
    assert ended >= 30 and called >= 10


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({"flag": st.booleans(), "zone": st.sampled_from(["UTC", False])}, optional={
    "nothing": st.none(), "level": st.one_of(st.none(), st.integers(-9, 9)), "mode": st.sampled_from(
        ['a"b', 1.5, True, None]), "note": st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]),
                                                   max_size=4),
    "tags": st.lists(st.one_of(st.booleans(), st.none(), st.text("ab\\\"\n", max_size=2)), max_size=3),
    "opts": st.fixed_dictionaries({}, optional={"on": st.booleans(), "off": st.none()})}))
def test_calls_written_as_the_grammar_writes_them_read_back(backend, arguments):
    """Arguments in the schema's order, Python's True/False/None at the top level and JSON inside containers: the
    grammar takes the text, and the reader gives the arguments back."""
    order = list(EVERYTHING["properties"])
    if "opts" in arguments:  # (its keys too in the schema's order, as %json writes them)
        arguments["opts"] = {key: arguments["opts"][key] for key in ("on", "off") if key in arguments["opts"]}
    written = ", ".join(f"{key}={_python(value)}" for key, value in sorted(arguments.items(),
                                                                          key=lambda kv: order.index(kv[0])))
    text = f"[everything({written})]"
    assert accepts(backend, pythonic_constraint(_tools(ALL_TOOLS), "required", False), text), text
    assert read([text], names=["everything"])[1] == [("everything", arguments)]


def _python(value) -> str:
    return repr(value) if value is None or isinstance(value, bool) else json.dumps(value, ensure_ascii=False)


PYTHONIC_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'user' and tools %}Call functions by answering with a Python list, [name(key=value, ...)]:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}
{%- if message.tool_calls %}[{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}
{{- call.function.name }}({% for key, value in call.function.arguments.items() %}{% if not loop.first %}, {% endif %}
{{- key }}={{ value | tojson }}{% endfor %}){% endfor %}]
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


server = tool_server_fixture("pythonic", PYTHONIC_TEMPLATE)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed, **{**SAMPLING, "max_tokens": 250})
    assert_calls_stream_as_plain(client, **kwargs)


def test_a_named_function_and_auto(client):
    assert_named_call(client, "get_time", messages=MESSAGES, tools=TOOLS, seed=3, parallel_tool_calls=False, **SAMPLING)
    for seed in range(4):
        auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=seed,
                                              **{**SAMPLING, "max_tokens": 8})
        choice = auto.choices[0]
        # text whose first character is not "[" is content; a list cut off by max_tokens is content too
        assert not choice.message.tool_calls and (choice.finish_reason == "length" or not choice.message.content
                                                  or not choice.message.content.lstrip().startswith("["))


def test_a_tool_python_cannot_call_is_a_400(client):
    import openai

    tools = [{"type": "function", "function": {"name": "get-time", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="Python names"):
        client.chat.completions.create(messages=MESSAGES, tools=tools, tool_choice="required", **SAMPLING)


def test_responses_give_function_call_items(client):
    assert_responses_call(client, TOOLS, max_output_tokens=120)
