"""The Responses API's function tools and output formats through the openai client, on the tiny model with the
Qwen2.5-style template of test_server_structured_output: calls as function_call items (plain, and streamed as
their typed events, which the client assembles), a call answered by the next turn through previous_response_id,
text.format's JSON schema and JSON object, and vLLM's structured_outputs."""

from __future__ import annotations

import json
from typing import Annotated

import pydantic
import pytest

from server_fixture import MODEL_NAME
from test_server_structured_output import SCHEMA, TOOLS, server, validate  # noqa: F401 (server: fixture)

FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat shape
PARAMETERS = {tool["name"]: tool["parameters"] for tool in FUNCTION_TOOLS}
QUESTION = "What is the weather in Paris?"
SAMPLING = dict(model=MODEL_NAME, temperature=1.0, max_output_tokens=120)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return server.openai()


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("seed", [3, 4])
def test_required_tool_choice_gives_one_function_call_item(client, seed):
    response = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, extra_body={"seed": seed}, **SAMPLING)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    (call,) = calls_of(response)
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    validate(PARAMETERS[call.name], call.arguments)
    assert response.tool_choice == "required" and [t.name for t in response.tools] == ["get_weather", "get_time"]
    assert response.output_text == ""


def test_a_named_function_and_none(client):
    named = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, extra_body={"seed": 5},
                                    tool_choice={"type": "function", "name": "get_time"}, **SAMPLING)
    (call,) = calls_of(named)
    assert call.name == "get_time" and named.tool_choice.name == "get_time"
    validate(PARAMETERS["get_time"], call.arguments)
    plain = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, tool_choice="none",
                                    **{**SAMPLING, "max_output_tokens": 6})
    assert [item.type for item in plain.output] == ["message"] and plain.output_text


def test_streamed_calls_assemble_into_the_response(client):
    kwargs = dict(input=QUESTION, tools=FUNCTION_TOOLS, tool_choice="required", extra_body={"seed": 6}, **SAMPLING)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    calls = len(calls_of(plain))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == calls
    assert kinds.count("response.function_call_arguments.done") == calls
    assert kinds.count("response.function_call_arguments.delta") > 2 * calls  # the arguments arrive in pieces
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the same seed writes the same calls (ids aside), and the stream's pieces add up to them
    assert [(c.name, c.arguments, c.status) for c in calls_of(final)] == \
        [(c.name, c.arguments, c.status) for c in calls_of(plain)]
    for index, call in enumerate(calls_of(final)):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        done = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert "".join(pieces) == done[0].arguments == call.arguments and done[0].item_id == call.id
        snapshots = [e.snapshot for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == index]
        assert snapshots[-1] == call.arguments  # the client's own assembly: no piece twice
        added = next(e.item for e in events if e.type == "response.output_item.added" and e.output_index == index)
        assert (added.arguments, added.status) == ("", "in_progress")


@pytest.mark.parametrize("stream", [False, True])
def test_text_before_a_call_is_a_message_item_then_the_call(client, stream):
    """auto reads the calls the model writes (a regex of the client's makes it write one after some text)."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    regex = "Checking\\.\n" + call.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(input=QUESTION, tools=FUNCTION_TOOLS, extra_body={"structured_outputs": {"regex": regex}},
                  **SAMPLING)
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
            response = events.get_final_response()
        assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))
    else:
        response = client.responses.create(**kwargs)
    message, function_call = response.output
    assert message.type == "message" and message.content[0].text == "Checking.\n" and message.status == "completed"
    assert (function_call.name, function_call.arguments) == ("get_time", '{"tz": "CET"}')


def test_a_call_answered_in_the_next_turn_renders_as_chat_does(client):
    first = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, extra_body={"seed": 7}, **SAMPLING)
    (call,) = calls_of(first)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    second = client.responses.create(previous_response_id=first.id, input=[answer], tools=FUNCTION_TOOLS,
                                     tool_choice="none", **{**SAMPLING, "temperature": 0, "max_output_tokens": 3})
    # the same conversation sent whole, without the stored turn, and as chat messages
    whole = client.responses.create(input=[{"role": "user", "content": QUESTION}, {
        "type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, answer],
        tools=FUNCTION_TOOLS, tool_choice="none", **{**SAMPLING, "temperature": 0, "max_output_tokens": 3})
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=3, tools=TOOLS,
                                          tool_choice="none", messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}])
    assert second.usage.input_tokens == whole.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == whole.output_text == chat.choices[0].message.content


class Record(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=8)]
    n: Annotated[int, pydantic.Field(ge=0, le=99)]


@pytest.mark.parametrize("seed", [1, 2])
def test_text_format_json_schema_and_json_object(client, seed):
    fmt = {"type": "json_schema", "name": "record", "schema": SCHEMA, "strict": True}
    response = client.responses.create(input="A record:", text={"format": fmt}, extra_body={"seed": seed},
                                       **SAMPLING)
    validate(SCHEMA, response.output_text)
    assert response.text.format.type == "json_schema" and response.text.format.name == "record"
    parsed = client.responses.parse(input="A record:", text_format=Record, extra_body={"seed": seed}, **SAMPLING)
    assert isinstance(parsed.output_parsed, Record)  # the client's own schema from the model, and its parse
    anything = client.responses.create(input="JSON:", text={"format": {"type": "json_object"}},
                                       extra_body={"seed": seed}, **{**SAMPLING, "max_output_tokens": 200})
    assert anything.output_text.startswith("{")
    if anything.status == "completed":  # (a random model may write a string longer than the limit)
        assert isinstance(json.loads(anything.output_text), dict)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_text_format_with_tools_applies_to_the_message(client, seed):
    """The OpenAI Agents SDK's pattern (output_type and tools): "auto" writes the format or calls; "required"
    calls first."""
    fmt = {"type": "json_schema", "name": "final_output", "schema": SCHEMA, "strict": True}
    auto = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, text={"format": fmt},
                                   parallel_tool_calls=False, extra_body={"seed": seed}, **SAMPLING)
    if calls_of(auto):
        assert [item.type for item in auto.output] == ["function_call"] and auto.status == "completed"
        validate(PARAMETERS[auto.output[0].name], auto.output[0].arguments)
    else:
        validate(SCHEMA, auto.output_text)
    required = client.responses.create(input=QUESTION, tools=FUNCTION_TOOLS, text={"format": fmt},
                                       tool_choice="required", parallel_tool_calls=False, extra_body={"seed": seed},
                                       **SAMPLING)
    assert calls_of(required) and required.status == "completed"


def test_structured_outputs_of_vllm(client):
    response = client.responses.create(input="Pick one:", extra_body={
        "structured_outputs": {"choice": ["red", "blue"]}, "seed": 3}, **SAMPLING)
    assert response.output_text in ("red", "blue") and response.status == "completed"


@pytest.mark.parametrize("use_responses_api", [True, False])
def test_langchain_binds_tools_over_both_apis(server, use_responses_api):  # noqa: F811
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=f"{server.base_url}/v1", api_key="none",
                                      use_responses_api=use_responses_api, max_tokens=120, temperature=1.0,
                                      extra_body={"seed": 9}, max_retries=0)
    tool = {"type": "function", "function": TOOLS[1]["function"]}
    message = llm.bind_tools([tool], tool_choice="get_time").invoke(QUESTION)
    (call,) = message.tool_calls
    assert call["name"] == "get_time" and call["id"].startswith("call_")
    validate(PARAMETERS["get_time"], json.dumps(call["args"]))
