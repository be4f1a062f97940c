"""Tool calls: the grammar tool_choice imposes, and the parser that reads Hermes-format calls back out of a choice's
text, whole or streamed piece by piece (it must give the same calls either way)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from folio.entrypoints.openai.tool_grammar import resolve_tool_choice, hermes_constraint
from folio.entrypoints.openai.tool_parser import BracketEnd, CallEnd, HermesToolCallReader, join_tool_calls
from tool_format_fixture import accepts, llguidance_backend

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": {}}]}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": params}})
         for name, params in (("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
                              ("get_time", None))]


def parse(text: str, piece: int) -> tuple[str, list, list]:
    """Feed text in pieces of `piece` characters; returns the content, the joined calls and the raw deltas."""
    parser = HermesToolCallReader()
    content, deltas = "", []
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    for i, chunk in enumerate(pieces):
        c, d = parser.feed(chunk, final=i == len(pieces) - 1)
        content += c
        deltas += d
    return content, join_tool_calls(deltas), deltas


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_same_calls(piece):
    content, calls, deltas = parse("Let me check.\n" + WEATHER + "\n" + TIME, piece)
    assert content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, {"x": {}}]}), ("get_time", {"tz": "UTC"})]
    assert calls[0].function.arguments == '{"city": "Paris", "days": [1, {"x": {}}]}'
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    openings = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in openings] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    if piece < 10:  # arguments arrive in several pieces, never with the call's closing text
        pieces = [d.function.arguments for d in deltas if d.id is None]
        assert len(pieces) > 2 and not any("</" in p or p.endswith("}}") for p in pieces[:-1])


def test_text_without_calls_is_content_even_when_it_looks_like_a_tag():
    for text in ("plain answer", "a < b and <tool but not a call", "ends with <tool_c"):
        assert parse(text, 1)[:2] == (text, [])


def test_a_call_in_another_key_order_is_sent_whole_and_garbage_stays_content():
    content, calls, _ = parse('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', 4)
    assert content == "" and [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a": 1}')]
    broken = "<tool_call>not json</tool_call>"
    assert parse(broken, 3)[:2] == (broken, [])


def test_a_call_cut_short_keeps_what_it_streamed():
    _, calls, _ = parse(WEATHER[:60], 5)
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == '{"city": "P'


def test_tool_choice_is_checked_against_the_tools():
    assert resolve_tool_choice(None, None) == "none" and resolve_tool_choice(TOOLS, None) == "auto"
    with pytest.raises(ValueError, match="tool_choice requires tools"):
        resolve_tool_choice(None, "required")
    with pytest.raises(ValueError, match="tool_choice names the function 'nope'"):
        resolve_tool_choice(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(ValueError, match="distinct function names"):
        resolve_tool_choice(TOOLS + TOOLS[:1], None)


def test_grammars_by_tool_choice():
    assert hermes_constraint(TOOLS, "none", True) is None
    required = hermes_constraint(TOOLS, "required", True).grammar
    assert required.startswith("%llguidance {}\nstart: \"<tool_call>\" call (\"\\n<tool_call>\" call)*")
    assert "call_0" in required and "call_1" in required and '"x-guidance"' in required
    assert "TEXT" not in hermes_constraint(TOOLS, "required", False).grammar.split("call:")[0].split("*")[-1]
    named = hermes_constraint(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_time"}}), True).grammar
    assert "get_time" in named and "get_weather" not in named and ")*" not in named
    auto = hermes_constraint(TOOLS, "auto", False).grammar
    assert "start: TEXT | text_then_open call\n" in auto and "[lazy]" in auto


def test_auto_with_a_message_format_writes_the_format_or_calls(llama_dir):
    """With a JSON format for the message, "auto" lets the output be a document of it or calls, not free text."""
    from folio import LLMEngine

    engine = LLMEngine.from_kwargs(llama_dir, dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
    tokenizer, backend = engine.get_tokenizer(), engine.structured_output.backend
    eos = min(backend.compile(hermes_constraint(TOOLS, "auto", True)).eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    constraint = hermes_constraint(TOOLS, "auto", True, message_schema=schema)

    def accepted(text: str) -> bool:
        grammar = backend.compile(constraint)
        return grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False) + [eos]) and \
            grammar.is_terminated()

    assert accepted('{"a": 1}') and accepted(TIME) and accepted(TIME + "\n" + TIME)
    assert not accepted("hello") and not accepted('{"b": 1}') and not accepted("Let me check.\n" + TIME)
    assert hermes_constraint(TOOLS, "required", True, message_schema=None).grammar == \
        hermes_constraint(TOOLS, "required", True).grammar


@pytest.mark.parametrize("name", ['a\\x', 'a\\ud800', "rm_rf"])
def test_a_call_of_a_name_that_is_no_tool_stays_content(name):
    """A bad JSON escape, a lone surrogate, or a function the request has no tool for: the text is content."""
    text = '<tool_call>\n{"name": "' + name + '", "arguments": {}}\n</tool_call>'
    for piece in (1, 5, 1000):
        parser = HermesToolCallReader(["get_time"])
        content, deltas = "", []
        for i in range(0, len(text), piece):
            c, d = parser.feed(text[i:i + piece], final=i + piece >= len(text))
            content, deltas = content + c, deltas + d
        assert (content, deltas, parser.num_calls) == (text, [], 0)
    whole = '<tool_call>{"arguments": {"s": "\\ud800"}, "name": "get_time"}</tool_call>'  # another key order
    (call,) = join_tool_calls(HermesToolCallReader(["get_time"]).feed(whole, final=True)[1])
    assert json.loads(call.function.arguments) == {"s": "\ud800"} and call.function.arguments.isascii()


def test_the_end_of_the_text_releases_what_was_held_back():
    parser = HermesToolCallReader()
    _, deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"x": {"y": 1}}')
    assert "".join(d.function.arguments for d in deltas) == '{"x": {"y": 1'  # the braces may close the call
    _, more = parser.feed("", final=True)  # cut there (max_tokens): they were the arguments'
    assert "".join(d.function.arguments for d in deltas + more) == '{"x": {"y": 1}}'
    assert HermesToolCallReader().feed('ok <tool_call>\n{"na', final=True) == ('ok <tool_call>\n{"na', [])


def test_pieces_keep_the_order_written():
    pieces = HermesToolCallReader().pieces("a" + TIME + "b" + TIME, final=True)
    kinds = [p if isinstance(p, str) else type(p).__name__ for p in pieces]
    assert kinds == ["a", "DeltaToolCall", "DeltaToolCall", "CallEnd", "b", "DeltaToolCall", "DeltaToolCall",
                     "CallEnd"]


@pytest.mark.parametrize("ending", ["", "\n", "\n</tool_", " \n</tool_call"])
def test_a_whole_call_object_without_its_closing_tag_is_a_call(ending):
    """The text stopped before </tool_call> (a stop string, end of sequence): the object is whole, so it is a call
    like any other, its own closing brace and the tag's start not in the arguments."""
    for piece in (1, 4, 1000):
        parser = HermesToolCallReader(["f"])
        text = '<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}' + ending
        deltas = []
        for i in range(0, len(text), piece):
            deltas += parser.feed(text[i:i + piece], final=i + piece >= len(text))[1]
        assert [(c.function.name, c.function.arguments) for c in join_tool_calls(deltas)] == [("f", '{"a": {"b": 1}}')]
        assert parser.num_calls == 1


def test_whitespace_after_a_call_is_dropped_however_the_tokens_split_it():
    for pieces in ([TIME + "\nDone."], [TIME, "\n", "Done."], [TIME + "\n", " Done."]):
        parser = HermesToolCallReader()
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.feed("", final=True)[0]
        assert content == "Done."


def test_a_body_nested_without_end_is_content_not_a_crash():
    text = "<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>"
    assert HermesToolCallReader(["f"]).feed(text, final=True) == (text, [])


_ATOMS = ["<tool_call>", "</tool_call>", "<tool_c", "all>", "</to", "\n", " ", "{", "}", '"name"', ": ", '"f"', ", ",
          '"arguments"', '{"a": 1}', "[", "]", "text", '"a\\x"', '{"arguments": {}, "name": "f"}',
          '{"name": "f", "arguments": {"k": "v"}}', '{"name": "f", "arguments": ', "}}", "</tool_"]


def _normalised(parser: HermesToolCallReader, pieces: list[str]) -> tuple[list, int]:
    """What a parser gives for the pieces, ids left out and runs of content and of one call's arguments joined."""
    out: list = []
    for i, piece in enumerate(pieces):
        for p in parser.pieces(piece, final=i == len(pieces) - 1):
            if isinstance(p, str):
                key, value = ("content",), p
            elif isinstance(p, CallEnd):
                out.append(("end", p.index))
                continue
            else:
                key, value = ("call", p.index, p.function.name), p.function.arguments or ""
            if out and out[-1][:-1] == key:
                out[-1] = (*key, out[-1][-1] + value)
            else:
                out.append((*key, value))
    return out, parser.num_calls


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=14).flatmap(
    lambda atoms: st.tuples(st.just("".join(atoms)), st.lists(st.integers(1, len("".join(atoms))), max_size=6))),
       st.sampled_from([None, ["f"]]))
def test_any_split_of_the_text_gives_what_the_whole_text_gives(text_and_cuts, names):
    """Content, calls and their ends do not depend on how the tokens split the text (the server feeds what each
    step decoded: one token, several with speculative decoding)."""
    text, cuts = text_and_cuts
    bounds = sorted(set(cuts) | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _normalised(HermesToolCallReader(names), pieces) == _normalised(HermesToolCallReader(names), [text])


def test_the_arguments_are_an_object_whatever_the_schema_says(llama_dir):
    """A schema without "type": "object" takes any JSON value: the grammar still writes an object (a string would
    be no call); a schema whose type is not an object's is refused (a 400 naming the tool)."""
    backend = llguidance_backend(llama_dir)
    untyped = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    required = hermes_constraint([untyped], "required", False)
    assert accepts(backend, required, '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(backend, required, '<tool_call>\n{"name": "f", "arguments": "Paris"}\n</tool_call>')
    nullable = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": ["object", "null"]}}})
    assert not accepts(backend, hermes_constraint([nullable], "required", False),
                       '<tool_call>\n{"name": "f", "arguments": null}\n</tool_call>')
    array = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}})
    with pytest.raises(ValueError, match="'f' are of type 'array', not an object"):
        hermes_constraint([array], "required", False)


@pytest.mark.parametrize("text", [
    '<tool_call>{"arguments": ARGUMENTS, "name": "f"}</tool_call>',  # another key order: sent whole
    '<tool_call>\n{"name": "f", "arguments": ARGUMENTS}',  # stopped before </tool_call>: whole all the same
])
def test_calls_sent_whole_keep_the_arguments_as_written(text):
    """Numbers Python would change (1e999 to inf, which no JSON holds) or could not read (5000 digits) stay the
    model's."""
    arguments = '{"n": 1e999, "i": ' + "9" * 5000 + "}"
    _, calls, _ = parse(text.replace("ARGUMENTS", arguments), 7)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", arguments)]


def test_an_empty_piece_keeps_a_pending_escape():
    end = BracketEnd()
    assert end.feed('{"a\\') == -1 and end.feed("") == -1
    assert end.feed('"}') == -1  # the quote was escaped: the string goes on
    assert end.feed('"}') == 2
