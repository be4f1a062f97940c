"""DeepSeek's tool calls (`--tool-call-parser deepseek_v3` and `deepseek_v31`): the reader of both forms on any split
of the text, the grammars with the markers written by id (on a tokenizer that has them as special tokens, and on one
that has them as plain added tokens), and through the server on copies of the tiny model with the markers and a
DeepSeek-style template of each form: tool_choice's grammars make the tiny random model write calls that come back as
tool_calls (chat, streamed and not) and function_call items (responses), with no marker in the content."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
from folio.entrypoints.openai.tool_deepseek import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, MARKERS, SEP,
                                                    DeepSeekTokens, DeepSeekToolCallReader, deepseek_constraint,
                                                    marker)
from folio.entrypoints.openai.tool_parser import CallEnd
from tool_format_fixture import (MESSAGES, SAMPLING, accepts, add_tokens, assert_calls_stream_as_plain,
                                 assert_named_call, assert_responses_call, assert_valid, cut, llguidance_backend,
                                 random_output, read_pieces, styled_model, tool_server)
from tool_format_fixture import client  # noqa: F401 (a fixture)

NAMES = ["get_time", "get_weather"]
FORMS = {True: "deepseek_v3", False: "deepseek_v31"}  # fenced: the tool_call_parser


def test_the_markers_are_deepseek_s_code_points():
    assert marker("tool calls begin").encode("unicode_escape") == b"<\\uff5ctool\\u2581calls\\u2581begin\\uff5c>"
    assert [m.encode("ascii", "replace") for m in MARKERS] == [
        b"<?tool?calls?begin?>", b"<?tool?calls?end?>", b"<?tool?call?begin?>", b"<?tool?call?end?>", b"<?tool?sep?>"]


def call(name: str, arguments: str, fenced: bool) -> str:
    """One call as DeepSeek writes it, V3's form where `fenced`, V3.1's otherwise."""
    if fenced:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def calls(*written: tuple[str, str], fenced: bool) -> str:
    """Calls as DeepSeek writes them, between the calls' markers (a newline between V3's)."""
    return CALLS_BEGIN + ("\n" if fenced else "").join(call(n, a, fenced) for n, a in written) + CALLS_END


def read(pieces: list[str], fenced: bool, names=NAMES, cut_off: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments' text) a choice's pieces give."""
    content, read_calls, _ = read_pieces(DeepSeekToolCallReader(names, fenced), pieces, cut_off)
    return content, [(c.function.name, c.function.arguments) for c in read_calls]


TIME, WEATHER = ("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Oslo"}')


def cases(fenced: bool) -> list[tuple[str, str, list, bool]]:
    """(text, content, calls, whether the text ends inside a call) in the form `fenced` says."""
    return [
        (calls(TIME, fenced=fenced), "", [TIME], False),
        ("Let me look. " + calls(TIME, WEATHER, fenced=fenced), "Let me look. ", [TIME, WEATHER], False),
        (calls(("get_time", '{"tz": "a}\\"```"}'), fenced=fenced) + " done", "done",
         [("get_time", '{"tz": "a}\\"```"}')], False),  # a string with a brace, a quote and a fence in it
        (calls(("launch", "{}"), TIME, fenced=fenced), ("functionlaunch\n```json\n{}\n```\n" if fenced else "launch{}"),
         [TIME], False),  # not one of the tools: content, without the markers
        (CALL_BEGIN + "get_time" + SEP + "{}" + CALL_END + " text", "get_time{} text", [], False),  # no calls' start
        (CALLS_BEGIN + call("get_time", '{"tz": "U', fenced)[:-len(CALL_END) - (4 if fenced else 0)], "",
         [("get_time", '{"tz": "U')], True),  # cut off (max_tokens)
        (CALLS_BEGIN + call("get_time", "{}", fenced).removesuffix(CALL_END), "", [("get_time", "{}")], False),
        (CALLS_BEGIN + CALL_BEGIN + "get_ti", "get_ti", [], False),  # cut before its name is known
        (f"a {CALLS_END}b{SEP} {CALL_END}c", "a b c", [], False),  # stray markers are dropped
        ("It is noon " + CALLS_BEGIN[:5], "It is noon " + CALLS_BEGIN[:5], [], False),
        ("", "", [], False),
    ]


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
def test_every_cut_reads_as_the_whole(fenced):
    for text, content, expected, cut_off in cases(fenced):
        assert read([text], fenced, cut_off=cut_off) == (content, expected), text
        assert read(list(text), fenced, cut_off=cut_off) == (content, expected), text
        for i in range(len(text)):
            assert read([text[:i], text[i:]], fenced, cut_off=cut_off) == (content, expected), (text, i)


def test_the_forms_are_not_each_other_s():
    """A V3 call read as V3.1 names "function", no function; a V3.1 call read as V3 has no name's line."""
    assert read([calls(TIME, fenced=True)], fenced=False)[1] == []
    assert read([calls(TIME, fenced=False)], fenced=True)[1] == []


def bits(fenced: bool) -> st.SearchStrategy:
    return st.sampled_from([*MARKERS, CALLS_BEGIN[:4], SEP[3:], call("get_time", '{"tz": "UTC"}', fenced), "function",
                            "get_time", "launch", "\n", "```json", "```", "\n```", " ", '{"a": "}', '"', "text"])


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_pieces_read_as_the_whole(fenced, data):
    text = "".join(data.draw(st.lists(bits(fenced), max_size=10)))
    pieces = cut(text, data.draw(st.lists(st.integers(0, 300), max_size=6)))
    reader, whole = DeepSeekToolCallReader(NAMES, fenced), DeepSeekToolCallReader(NAMES, fenced)
    split = [p for i, piece in enumerate(pieces) for p in reader.pieces(piece, final=i == len(pieces) - 1)]
    joined = whole.pieces(text, final=True)

    def plain(out: list) -> tuple:
        content = "".join(p for p in out if isinstance(p, str))
        deltas = [(p.index, p.function.name, p.function.arguments) for p in out if not isinstance(p, (str, CallEnd))]
        merged: dict[int, list] = {}
        for index, name, arguments in deltas:
            merged.setdefault(index, [name, ""])[1] += arguments or ""
        return content, merged, [p for p in out if isinstance(p, CallEnd)]

    assert plain(split) == plain(joined)
    assert not any(m in plain(split)[0] for m in MARKERS)


def test_arguments_stream_as_they_come():
    reader = DeepSeekToolCallReader(NAMES, fenced=True)
    assert reader.pieces("Sure." + CALLS_BEGIN + CALL_BEGIN + "function" + SEP[:4]) == ["Sure."]
    (opening,) = reader.pieces(SEP[4:] + "get_time\n``")
    assert opening.function.name == "get_time" and opening.id and opening.function.arguments == ""
    assert [p.function.arguments for p in reader.pieces('`json\n{"tz": "U')] == ['{"tz": "U']
    assert [p.function.arguments for p in reader.pieces('TC"}\n``')] == ['TC"}']  # the fence held back
    assert reader.pieces("`" + CALL_END[:3]) == []
    assert reader.pieces(CALL_END[3:] + CALLS_END) == [CallEnd(0)]


NUMBERS = '{"n": 1e999, "m": -1.0000000000000000001E-2, "i": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
def test_arguments_go_out_as_written(fenced):
    """Numbers Python would change or could not read are the model's: the arguments are their JSON text as
    written."""
    text = calls(("get_time", NUMBERS), fenced=fenced)
    assert read(cut(text, [5, 40, 2000]), fenced) == ("", [("get_time", NUMBERS)])


DEEPSEEK_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content or '' }}
{%- if message.tool_calls %}CALLS_BEGIN{% for call in message.tool_calls %}
{%- if not loop.first and fenced %}{{ '\\n' }}{% endif %}CALL_BEGIN
{%- if fenced %}functionSEP{{ call.function.name + '\\n```json\\n' }}{{ call.function.arguments | tojson }}
{{- '\\n```' }}
{%- else %}{{ call.function.name }}SEP{{ call.function.arguments | tojson }}{% endif %}CALL_END{% endfor %}CALLS_END
{%- endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def deepseek_template(fenced: bool) -> str:
    """A DeepSeek-style template of the V3 form (fenced) or the V3.1 form, on the tiny tokenizer's turn tokens."""
    text = DEEPSEEK_TEMPLATE.replace("fenced", "true" if fenced else "false")
    for name, value in (("CALLS_BEGIN", CALLS_BEGIN), ("CALLS_END", CALLS_END), ("CALL_BEGIN", CALL_BEGIN),
                        ("CALL_END", CALL_END), ("SEP", SEP)):
        text = text.replace(name, value)
    return text


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


def deepseek_folder(llama_dir: str, folder: str, fenced: bool, special: bool = True) -> str:
    """A copy of the tiny model whose tokenizer has DeepSeek's markers (special tokens, or plain added ones) and a
    DeepSeek-style template of the form `fenced` says."""
    styled_model(llama_dir, folder, deepseek_template(fenced))
    add_tokens(folder, list(MARKERS), special)
    return folder


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
def test_the_template_renders_calls_the_reader_reads(llama_dir, tmp_path, fenced):
    from folio.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(deepseek_folder(llama_dir, str(tmp_path), fenced))
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate((TIME, WEATHER))]}]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=False, tools=TOOLS)
    answer = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")  # (as the model writes it)
    assert answer == calls(TIME, WEATHER, fenced=fenced)
    assert read([answer], fenced) == ("", [TIME, WEATHER])


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
@pytest.mark.parametrize("special", [True, False], ids=["special", "plain"])
def test_the_grammars_take_what_the_reader_reads(llama_dir, tmp_path, fenced, special):
    backend = llguidance_backend(deepseek_folder(llama_dir, str(tmp_path), fenced, special))
    tools = [ChatTool.model_validate(tool) for tool in TOOLS]
    tokens = DeepSeekTokens.of(backend[0])

    def constraint(tool_choice, parallel=True, schema=None):
        return deepseek_constraint(tools, tool_choice, parallel, schema, tokens=tokens, fenced=fenced)

    time_call = calls(TIME, fenced=fenced)
    weather = ("get_weather", '{"city": "Oslo", "unit": "C"}')
    weather_call, two_calls = calls(weather, fenced=fenced), calls(TIME, weather, fenced=fenced)
    for text in (time_call, two_calls, "It is noon.", "", "It is " + time_call):
        assert accepts(backend, constraint("auto"), text), text
        assert bool(read([text], fenced)[1]) == (CALLS_BEGIN in text)
    other_form = calls(TIME, fenced=not fenced)
    for text in (time_call.replace("UTC", "PST"), other_form, time_call + " then", "a " + CALLS_BEGIN + "b",
                 time_call.replace(CALLS_END, "")):
        assert not accepts(backend, constraint("auto"), text), text  # (free text cannot hold the calls' start)
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
    # the markers are their tokens: the same characters written as other tokens are refused
    tokenizer = backend[0]
    as_text = tokenizer.encode(CALLS_BEGIN[:3], add_special_tokens=False) + tokenizer.encode(
        time_call[3:], add_special_tokens=False)
    assert tokens.calls_begin not in as_text and not backend[1].compile(required).accept_tokens(as_text)
    spelled = [i for char in "It is " + time_call for i in tokenizer.encode(char, add_special_tokens=False)]
    assert backend[0].decode(spelled) == "It is " + time_call  # (a call in free text, which the reader would read)
    assert not backend[1].compile(constraint("auto")).accept_tokens(spelled)


@pytest.mark.parametrize("fenced", [True, False], ids=FORMS.values())
def test_every_output_of_the_grammars_reads_as_valid_calls(llama_dir, tmp_path, fenced):
    """Random walks through the grammars: what they write reads back as calls of the tools, valid by jsonschema."""
    backend = llguidance_backend(deepseek_folder(llama_dir, str(tmp_path), fenced))
    tokenizer, tools = backend[0], [ChatTool.model_validate(tool) for tool in TOOLS]
    tokens = DeepSeekTokens.of(tokenizer)
    texts = [*MARKERS, "function", "get_time\n```json\n", '{"tz": "UTC"}', '{"city": "', '", "unit": "C"}', "\n```",
             "get_weather", "\n", "text"]
    chunks = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    rng, read_calls = random.Random(0), 0
    for choice in ("required", "auto", NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))):
        params = deepseek_constraint(tools, choice, True, tokens=tokens, fenced=fenced)
        for _ in range(40):
            ids = random_output(backend, params, rng, chunks)
            if ids is None:
                continue
            content, got = read([tokenizer.decode(ids, skip_special_tokens=False)], fenced)
            assert got or choice == "auto", ids
            for name, arguments in got:
                jsonschema.validate(json.loads(arguments), next(t["function"]["parameters"] for t in TOOLS
                                                                 if t["function"]["name"] == name))
            read_calls += len(got)
    assert read_calls >= 20  # (the walks do reach the ends of calls)


def test_a_tokenizer_without_the_markers_is_refused(llama_dir):
    from folio.entrypoints.openai.tool_call_format import TOOL_CALL_FORMATS
    from folio.tokenizer import Tokenizer

    for name in FORMS.values():
        with pytest.raises(ValueError, match="tool-call tokens"):
            TOOL_CALL_FORMATS[name].resolve(Tokenizer.from_dir(llama_dir))


@pytest.fixture(scope="module", params=[True, False], ids=FORMS.values())
def fenced(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def folder(fenced, llama_dir, tmp_path_factory) -> str:
    return deepseek_folder(llama_dir, str(tmp_path_factory.mktemp("deepseek-style")), fenced)


@pytest.fixture(scope="module")
def server(folder, fenced):
    with tool_server(folder, FORMS[fenced]) as s:
        yield s


@pytest.fixture(scope="module")
def marker_id(folder) -> int:
    from folio.tokenizer import Tokenizer

    return DeepSeekTokens.of(Tokenizer.from_dir(folder)).calls_begin


SERVER_SAMPLING = {**SAMPLING, "max_tokens": 250}


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_stream_as_they_are_plain(client, seed):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed, **SERVER_SAMPLING)
    assert assert_calls_stream_as_plain(client, **kwargs)[1] == ""  # no marker, no end of sequence in the content


def test_a_named_function(client):
    assert_named_call(client, "get_time", messages=MESSAGES, tools=TOOLS, seed=3, **SERVER_SAMPLING)


def test_auto_is_text_or_calls_and_no_marker_reaches_the_content(client, marker_id):
    # <|im_start|>, a special token, made all but certain; the end of sequence and the calls' start never
    pushed = {"1": 100, "2": -100, str(marker_id): -100}
    for seed in range(2):
        choice = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=seed, logit_bias=pushed,
                                                **{**SAMPLING, "max_tokens": 8}).choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "length"
        assert choice.message.content and "<|" not in choice.message.content  # free text holds no special token
    choice = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=4, logit_bias={str(marker_id): 30},
                                            parallel_tool_calls=False, **SERVER_SAMPLING).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert not any(m in (choice.message.content or "") for m in MARKERS)
    for tool_call in choice.message.tool_calls:
        assert_valid(tool_call, TOOLS)


def test_responses_give_function_call_items(client):
    assert_responses_call(client, TOOLS, max_output_tokens=250)
