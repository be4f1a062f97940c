"""Tool calls: the grammar tool_choice imposes, and the parser that reads Hermes-format calls back out of a choice's
text, whole or streamed piece by piece (it must give the same calls either way)."""

from __future__ import annotations

import json

import pytest

from folio.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from folio.entrypoints.openai.tool_grammar import resolve_tool_choice, tool_choice_constraint
from folio.entrypoints.openai.tool_parser import ToolCallParser, join_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": {}}]}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": params}})
         for name, params in (("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
                              ("get_time", None))]


def parse(text: str, piece: int) -> tuple[str, list, list]:
    """Feed text in pieces of `piece` characters; returns the content, the joined calls and the raw deltas."""
    parser = ToolCallParser()
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
    assert tool_choice_constraint(TOOLS, "none", True) is None
    required = tool_choice_constraint(TOOLS, "required", True).grammar
    assert required.startswith("%llguidance {}\nstart: \"<tool_call>\" call (\"\\n<tool_call>\" call)*")
    assert "call_0" in required and "call_1" in required and '"x-guidance"' in required
    assert "TEXT" not in tool_choice_constraint(TOOLS, "required", False).grammar.split("call:")[0].split("*")[-1]
    named = tool_choice_constraint(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_time"}}), True).grammar
    assert "get_time" in named and "get_weather" not in named and ")*" not in named
    auto = tool_choice_constraint(TOOLS, "auto", False).grammar
    assert "start: TEXT | text_then_open call\n" in auto and "[lazy]" in auto
