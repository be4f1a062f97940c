"""Mistral's tool calls (`--tool-call-parser mistral`): the reader on both forms and any split of the text, the
grammars of both forms with the markers as special tokens, and through the server on copies of the tiny model
whose tokenizers have [TOOL_CALLS] (and, for the v11 form, [ARGS]) as special tokens and a Mistral-style template:
tool_choice's grammars make the tiny random model write calls that come back as tool_calls (chat, streamed and
not) and function_call items (responses), with neither the markers nor the end-of-sequence token in the content."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.tool_mistral import MistralTokens, MistralToolCallReader, mistral_constraint
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, assert_calls_stream_as_plain, assert_named_call,
                                 assert_responses_call, assert_valid, cut, llguidance_backend, read_pieces,
                                 styled_model, tool_server)
from tool_format_fixture import client  # noqa: F401 (a fixture)

NAMES = ["get_time", "get_weather"]


def read(pieces: list[str], names=NAMES) -> tuple[str, list[tuple[str, dict]], list]:
    """The content and the calls (name, arguments) a choice's pieces give, and every piece read."""
    content, calls, out = read_pieces(MistralToolCallReader(names), pieces)
    for call in calls:
        assert len(call.id) == 9 and call.id.isalnum()  # as Mistral's templates take ids back
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls], out


TIME, WEATHER_OSLO = ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})


CASES = [
    # before v11: a JSON list
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]', "", [TIME]),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_weather", "arguments": '
     '{"city": "Oslo"}, "id": "abcDEF123"}]', "", [TIME, WEATHER_OSLO]),
    ('Let me look.[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "a\\"}"}}]\n', "Let me look.",
     [("get_time", {"tz": 'a"}'})]),  # a brace in a string; the text before the marker is content
    # what is not a call is content, without the markers (special tokens, in the text only to read calls)
    ('[TOOL_CALLS][{"name": "launch", "arguments": {}}]', '[{"name": "launch", "arguments": {}}]', []),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]',
     ', {"name": "launch", "arguments": {}}]', [("get_time", {})]),  # the calls up to the one that is not
    ('[TOOL_CALLS][{"name": "get_time", "arguments": "UTC"}]', '[{"name": "get_time", "arguments": "UTC"}]', []),
    ('[TOOL_CALLS][]', "[]", []),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "U', '[{"name": "get_time", "arguments": {"tz": "U',
     []),  # cut off
    # v11 and later: the name, [ARGS], the arguments, for each call
    ('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "", [TIME]),
    ('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS] {"city": "Oslo"}',
     "", [TIME, WEATHER_OSLO]),
    ('Sure. [TOOL_CALLS]get_time[ARGS]{"tz": "UTC"} done', "Sure. done", [TIME]),
    ('[TOOL_CALLS]launch[ARGS]{}', "launch{}", []),
    ('[TOOL_CALLS]get time[ARGS]{}', "get time{}", []),
    ('[TOOL_CALLS]get_time[ARGS][1]', "get_time[1]", []),
    ('[TOOL_CALLS]get_time[ARGS]{"tz": ', 'get_time{"tz": ', []),  # cut off (max_tokens)
    ('[TOOL_CALLS]get_time[CALL_ID]a1B2[ARGS]{"tz": ', 'get_timea1B2{"tz": ', []),
    ('[TOOL_CALLS]get_time[AR', "get_time[AR", []),
    # both forms in one text; no marker at all
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}] [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
     "", [TIME, WEATHER_OSLO]),
    ("It is noon [TOOL_C", "It is noon [TOOL_C", []),
    ("", "", []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_reads(text, content, calls):
    assert read([text])[:2] == (content, calls)


@pytest.mark.parametrize("text", [text for text, _, _ in CASES])
def test_every_cut_reads_as_the_whole(text):
    whole = read([text])[:2]
    assert read(list(text))[:2] == whole
    for i in range(len(text)):
        assert read([text[:i], text[i:]])[:2] == whole, i


BITS = st.sampled_from(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL", "_CALLS]", "[AR", "get_time", "get_weather",
                        "launch", '[{"name": "get_time", "arguments": {"tz": "UTC"}}', '{"city": "a}b"}', ", ", "]",
                        "[", " ", "\n", "{", "}", "text", '"', "\\", "a1B2c3D4e",
                        '[TOOL_CALLS]get_time[ARGS]{"tz": "\\"}"}',
                        '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}'])


@settings(max_examples=400, deadline=None)
@given(st.lists(BITS, max_size=10), st.lists(st.integers(0, 200), max_size=6))
def test_any_pieces_read_as_the_whole(bits, cuts):
    text = "".join(bits)
    pieces = cut(text, cuts)
    assert read(pieces)[:2] == read([text])[:2]


def test_calls_go_out_as_each_completes():
    parser = MistralToolCallReader(NAMES)
    assert parser.pieces("Sure[TOOL") == ["Sure"]  # the start of a marker waits
    assert parser.pieces('_CALLS][{"name": "get_time", "arguments": {"tz": ') == []
    first = parser.pieces('"UTC"}}, {"name": "get_weather"')
    assert [type(p).__name__ for p in first] == ["DeltaToolCall", "CallEnd"] and first[0].function.name == "get_time"
    assert parser.pieces("", final=True) == [', {"name": "get_weather"']  # a call cut off is content


MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- if v11 %}{% for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]
{{- call.function.arguments | tojson }}{% endfor %}
{%- else %}[TOOL_CALLS][{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}
{{- {"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson }}{% endfor %}]
{%- endif %}<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}<|im_end|>{% endif %}
{%- endfor %}"""


def mistral_folder(llama_dir: str, folder: str, v11: bool) -> str:
    """A copy of the tiny model whose tokenizer has Mistral's markers as special tokens (ids within its vocab, which
    the trained tokenizer leaves room for) and a Mistral-style template, for the v11 form or the one before."""
    from tokenizers import AddedToken, Tokenizer as Backend

    styled_model(llama_dir, folder, MISTRAL_TEMPLATE.replace("v11", "true" if v11 else "false"))
    backend = Backend.from_file(os.path.join(folder, "tokenizer.json"))
    markers = ["[TOOL_CALLS]"] + (["[ARGS]", "[CALL_ID]"] if v11 else [])
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "config.json")) as f:
        assert max(backend.token_to_id(m) for m in markers) < json.load(f)["vocab_size"]
    return folder


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module", params=[False, True], ids=["list", "v11"])
def folder(request, llama_dir, tmp_path_factory):
    return mistral_folder(llama_dir, str(tmp_path_factory.mktemp("mistral-style")), request.param)


@pytest.fixture(scope="module")
def backend(folder):
    return llguidance_backend(folder)


def test_the_grammars_take_what_the_reader_reads(backend):
    from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice

    tokenizer, _ = backend
    tokens = MistralTokens.of(tokenizer)
    tools = [ChatTool.model_validate(tool) for tool in TOOLS]

    def constraint(tool_choice, parallel=True, schema=None):
        return mistral_constraint(tools, tool_choice, parallel, schema, tokens=tokens)

    if tokens.args is None:
        time_call = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]'
        two_calls = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_weather", ' \
                    '"arguments": {"city": "Oslo", "unit": "C"}}]'
        weather_call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]'
        other_form = '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    else:
        time_call = '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
        weather_call = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "C"}'
        two_calls = time_call + weather_call
        other_form = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    for text in (time_call, two_calls, "It is noon.", "", "It is " + time_call):
        assert accepts(backend, constraint("auto"), text), text
        assert bool(read([text])[1]) == ("[TOOL_CALLS]" in text)
    for text in (time_call.replace("UTC", "PST"), other_form, time_call + " then", "a <|im_start|>"):
        assert not accepts(backend, constraint("auto"), text), text  # (only the grammar's form; no special token)
    # Mistral-7B-v0.3 (SentencePiece) writes "▁[" after the marker: the list form takes a space there, v11 none
    spaced = time_call.replace("[TOOL_CALLS]", "[TOOL_CALLS] ")
    assert accepts(backend, constraint("auto"), spaced) == (tokens.args is None)
    assert read([spaced])[1] == [TIME]
    formatted = constraint("auto", schema={"type": "object", "properties": {"answer": {"type": "integer"}},
                                           "required": ["answer"]})
    for text in ('{"answer": 1}', time_call, two_calls):  # a message in the format, or calls
        assert accepts(backend, formatted, text), text
    assert not accepts(backend, formatted, "It is noon.")
    named = constraint(NamedToolChoice(type="function", function=NamedFunction(name="get_time")))
    assert accepts(backend, named, time_call) and not accepts(backend, named, weather_call)
    assert not accepts(backend, named, two_calls)
    required = constraint("required", parallel=False)
    assert accepts(backend, required, weather_call) and not accepts(backend, required, "It is noon.")
    assert not accepts(backend, required, two_calls) and accepts(backend, constraint("required"), two_calls)
    # the marker must be the special token: the same characters written as plain text are refused
    as_text = tokenizer.encode("[TOOL", add_special_tokens=False) + tokenizer.encode(
        time_call.removeprefix("[TOOL"), add_special_tokens=False)
    assert tokens.tool_calls not in as_text and not backend[1].compile(required).accept_tokens(as_text)


def test_the_arguments_are_an_object_whatever_the_schema_says(backend):
    """A schema without "type": "object" takes any JSON value: the grammar still writes an object, which the
    reader reads (a string would be no call, and the marker's text would be all the content)."""
    from folio.entrypoints.openai.protocol import ChatTool

    tokens = MistralTokens.of(backend[0])
    tools = [ChatTool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
        "properties": {"tz": {"type": "string", "maxLength": 3}}, "required": ["tz"]}}})]
    required = mistral_constraint(tools, "required", False, tokens=tokens)
    as_list = tokens.args is None
    for arguments, ok in (('{"tz": "UTC"}', True), ('"UTC"', False), ("1", False), ("null", False)):
        text = f'[TOOL_CALLS][{{"name": "get_time", "arguments": {arguments}}}]' if as_list else \
            f"[TOOL_CALLS]get_time[ARGS]{arguments}"
        assert accepts(backend, required, text) == ok, text
        assert bool(read([text])[1]) == ok


NUMBERS = '{"n": 1e999, "m": -1.0000000000000000001E-2, "i": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("text", [f"[TOOL_CALLS]get_time[ARGS]{NUMBERS}",
                                  f'[TOOL_CALLS][{{"name": "get_time", "arguments": {NUMBERS}, "id": "a1"}}]',
                                  f'[TOOL_CALLS] [{{"id": "a1", "arguments": {NUMBERS},"name":"get_time"}}]'])
def test_arguments_go_out_as_written(text):
    """Numbers Python would change (1e999 to inf, which no JSON holds; 1.0000000000000000001 to 1.0) or could not
    read (5000 digits) are the model's: the arguments are their JSON text as written."""
    content, (tool_call,), _ = read_pieces(MistralToolCallReader(NAMES), cut(text, [5, 30, 2000]))
    assert content == "" and tool_call.function.arguments == NUMBERS


def test_a_tokenizer_without_the_marker_is_refused(llama_dir):
    from folio.entrypoints.openai.tool_call_format import TOOL_CALL_FORMATS
    from folio.tokenizer import Tokenizer

    with pytest.raises(ValueError, match=r"\[TOOL_CALLS\]"):
        TOOL_CALL_FORMATS["mistral"].resolve(Tokenizer.from_dir(llama_dir))




@pytest.fixture(scope="module")
def server(folder):
    with tool_server(folder, "mistral") as s:
        yield s


@pytest.fixture(scope="module")
def marker_id(folder):
    from folio.tokenizer import Tokenizer

    return MistralTokens.of(Tokenizer.from_dir(folder)).tool_calls


def _valid(call) -> None:
    assert len(call.id) == 9 and call.id.isalnum()
    assert_valid(call, TOOLS)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed, **{**SAMPLING, "max_tokens": 250})
    # the markers and the end-of-sequence token kept out of the content: none at all beside the calls
    calls, streamed_content = assert_calls_stream_as_plain(client, **kwargs)
    for call in calls:
        _valid(call)
    assert streamed_content == ""


def test_a_named_function(client):
    call = assert_named_call(client, "get_time", messages=MESSAGES, tools=TOOLS, seed=3, **SAMPLING)
    _valid(call)


def test_auto_is_text_or_calls_and_no_special_token_reaches_the_content(client, marker_id):
    # <|im_start|>, a special token, made all but certain; the end of sequence and [TOOL_CALLS] never
    pushed = {"1": 100, "2": -100, str(marker_id): -100}
    for seed in range(3):
        auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=seed, logit_bias=pushed,
                                              **{**SAMPLING, "max_tokens": 8})
        choice = auto.choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "length"
        assert choice.message.content and "<|" not in choice.message.content  # free text holds no special token
    # [TOOL_CALLS] made likely: "auto" gives calls
    auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=4, logit_bias={str(marker_id): 30},
                                          parallel_tool_calls=False, **{**SAMPLING, "max_tokens": 250})
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert "[TOOL_CALLS]" not in (choice.message.content or "") and "<|" not in (choice.message.content or "")
    for call in choice.message.tool_calls:
        _valid(call)
    # with tool_choice "none", special tokens are left out of the text as usual
    none = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="none", seed=5,
                                          logit_bias={str(marker_id): 100}, **{**SAMPLING, "max_tokens": 4})
    assert not none.choices[0].message.tool_calls and "[TOOL_CALLS]" not in none.choices[0].message.content


def test_a_conversation_with_calls_goes_on(client):
    first = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=6,
                                           parallel_tool_calls=False, **{**SAMPLING, "max_tokens": 250})
    (call,) = first.choices[0].message.tool_calls
    messages = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="required", seed=7,
                                           **{**SAMPLING, "max_tokens": 250})
    for call in again.choices[0].message.tool_calls:
        _valid(call)


def test_responses_give_function_call_items(client):
    call = assert_responses_call(client, TOOLS, max_output_tokens=120)
    assert len(call.call_id) == 9
