"""A Responses API turn's output items from the engine's text (folio.entrypoints.openai.responses_turn): items in the
order written whatever arrives in one output, events that show each item as it was when it happened, the stored
turn as chat sees it, and input items sent back rendering as the stored turn does."""

from __future__ import annotations

from folio.entrypoints.openai.protocol_responses import ResponsesRequest
from folio.entrypoints.openai.responses_turn import CallItem, MessageItem, Turn
from folio.entrypoints.openai.serving_responses import chat_messages
from folio.entrypoints.openai.tool_parser import HermesToolCallReader
from folio.outputs import CompletionOutput, RequestOutput
from folio.sampling_params import SamplingParams

TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def turn() -> Turn:
    request = ResponsesRequest.model_validate({"input": "hi", "tools": [
        {"type": "function", "name": "get_time"}, {"type": "function", "name": "get_weather"}]})
    return Turn(request, SamplingParams(), "m", [], 3, HermesToolCallReader(["get_time", "get_weather"]))


def output(text: str, finish: str = None) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [5], finish_reason=finish)], finish is not None)


def kinds(edits) -> list[tuple[str, str, int]]:
    return [(e.kind, type(e.item).__name__, e.item.output_index) for e in edits]


def test_one_output_with_text_calls_and_text_keeps_their_order():
    t = turn()
    edits = t.add(output("Before\n" + TIME + "\n" + WEATHER + "\nAfter", finish="stop")) + t.finish()
    assert [(type(i).__name__, getattr(i, "text", None) or getattr(i, "name")) for i in t.items] == [
        ("MessageItem", "Before\n"), ("CallItem", "get_time"), ("CallItem", "get_weather"), ("MessageItem", "After")]
    assert kinds(edits) == [
        ("added", "MessageItem", 0), ("delta", "MessageItem", 0), ("done", "MessageItem", 0),
        ("added", "CallItem", 1), ("delta", "CallItem", 1), ("done", "CallItem", 1),
        ("added", "CallItem", 2), ("delta", "CallItem", 2), ("done", "CallItem", 2),
        ("added", "MessageItem", 3), ("delta", "MessageItem", 3), ("done", "MessageItem", 3)]
    response = t.response()
    assert response.status == "completed" and [item.status for item in response.output] == ["completed"] * 4


def test_events_show_each_item_as_it_was_then():
    t = turn()
    first = t.add(output("Hello"))
    added = next(e for e in first if e.kind == "added")
    assert added.snapshot.content == [] and added.snapshot.status == "in_progress"  # its part comes next, empty
    edits = t.add(output(" there " + TIME, finish="stop"))  # the call opens and closes in one output
    call_added = next(e for e in edits if e.kind == "added")
    assert (call_added.snapshot.arguments, call_added.snapshot.status) == ("", "in_progress")
    message_done = next(e for e in edits if e.kind == "done" and isinstance(e.item, MessageItem))
    assert message_done.snapshot.content[0].text == "Hello there " and message_done.snapshot.status == "completed"
    call_done = next(e for e in edits if e.kind == "done" and isinstance(e.item, CallItem))
    assert (call_done.snapshot.arguments, call_done.snapshot.status) == ('{"tz": "UTC"}', "completed")


def test_a_call_cut_short_is_incomplete_and_keeps_its_arguments():
    t = turn()
    t.add(output('<tool_call>\n{"name": "get_time", "arguments": {"tz": {"a": 1}}'))
    edits = t.add(output("", finish="length")) + t.finish()
    (call,) = t.items
    assert call.arguments == '{"tz": {"a": 1}}' and t.response().output[0].status == "incomplete"
    assert [e.kind for e in edits] == ["delta", "done"] and edits[-1].snapshot.status == "incomplete"
    cut = turn()  # cut before the call's name: the text it was
    cut.add(output('Hm <tool_call>\n{"na', finish="length"))
    cut.finish()
    assert [type(i).__name__ for i in cut.items] == ["MessageItem"] and cut.items[0].text == 'Hm <tool_call>\n{"na'


def test_the_stored_turn_and_its_output_sent_back_render_alike():
    t = turn()
    t.add(output("Checking.\n" + TIME, finish="stop"))
    t.finish()
    (stored,) = t.assistant_messages()
    assert stored.content == "Checking.\n" and [c.function.name for c in stored.tool_calls] == ["get_time"]
    sent_back = [item.model_dump() for item in t.response().output]
    replay = chat_messages(ResponsesRequest.model_validate({"input": sent_back + [
        {"type": "function_call_output", "call_id": stored.tool_calls[0].id,
         "output": [{"type": "input_text", "text": "12:00"}]}]}).input)
    assert [m.role for m in replay] == ["assistant", "tool"] and replay[1].content == "12:00"
    assert [part.text for part in replay[0].content] == ["Checking.\n"]  # (the template gets them as a string)
    assert replay[0].tool_calls == stored.tool_calls
    twice = turn()  # text, a call, then text the parser did not read as a call: two assistant turns either way
    twice.add(output("A " + TIME + " <tool_call>oops</tool_call>", finish="stop"))
    twice.finish()
    sent_back = [item.model_dump() for item in twice.response().output]
    replay = chat_messages(ResponsesRequest.model_validate({"input": sent_back}).input)
    assert [(m.content if isinstance(m.content, str) else "".join(p.text for p in m.content), bool(m.tool_calls))
            for m in replay] == [(m.content, bool(m.tool_calls)) for m in twice.assistant_messages()] == [
        ("A ", True), ("<tool_call>oops</tool_call>", False)]
