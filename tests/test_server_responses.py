"""The Responses API through the openai client: plain and streamed (typed events), instructions, input items,
previous_response_id, store, GET and DELETE; its answers equal chat completions' for the same conversation.
Tools and output formats: test_server_responses_tools.py."""

from __future__ import annotations

import openai
import pytest

from folio.entrypoints.openai.protocol_responses import ResponseObject
from folio.entrypoints.openai.responses_store import ResponseStore
from server_fixture import MODEL_NAME

GREEDY = dict(model=MODEL_NAME, temperature=0)
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
ITEMS = [
    {"role": "developer", "content": "Use the tools."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    CALL,
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]
# The same turns as chat messages.
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def client(llama_server):
    return llama_server.openai()


def chat(client, messages, max_tokens, **extra):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, extra_body=extra, **GREEDY)


def test_create_retrieve_delete(client):
    response = client.responses.create(input="hello world", max_output_tokens=5, metadata={"k": "v"}, **GREEDY)
    expected = chat(client, [{"role": "user", "content": "hello world"}], 5)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == expected.choices[0].message.content
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (expected.usage.prompt_tokens, 5)
    assert response.metadata == {"k": "v"} and response.temperature == 0 and response.store
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_instructions_and_input_items_render_as_chat(client):
    response = client.responses.create(instructions="be brief", input=ITEMS, max_output_tokens=4, **GREEDY)
    expected = chat(client, MESSAGES, 4)
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_previous_response_id_continues_without_instructions(client):
    first = client.responses.create(instructions="be brief", input="hello", max_output_tokens=4, **GREEDY)
    second = client.responses.create(previous_response_id=first.id, input="and more", max_output_tokens=4, **GREEDY)
    expected = chat(client, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "and more"}], 4)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens and second.previous_response_id == first.id

    unstored = client.responses.create(input="hello", max_output_tokens=2, store=False, **GREEDY)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|Previous response"):
        client.responses.create(previous_response_id=unstored.id, input="x", **GREEDY)


def test_stream_events_assemble_into_the_response(client):
    kwargs = dict(input="hello world", **GREEDY)
    text = client.responses.create(max_output_tokens=8, **kwargs).output_text
    stop = text[3:5]  # a stop string (vLLM's extra) that ends the response early: status completed
    plain = client.responses.create(max_output_tokens=8, extra_body={"stop": [stop]}, **kwargs)
    assert plain.status == "completed" and plain.output_text == text[:text.index(stop)]

    with client.responses.stream(max_output_tokens=8, extra_body={"stop": [stop]}, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + [
                        "response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == plain.output_text and final.status == "completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.content == [] and added.item.status == "in_progress"  # the text comes in the deltas
    assert [e.snapshot for e in events if e.type == "response.output_text.delta"][-1] == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == final.output_text

    events = list(client.responses.create(max_output_tokens=3, stream=True, **kwargs))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text == streamed
    assert text.startswith(streamed) and events[-1].response.usage.output_tokens == 3


def test_truncation_auto_drops_the_oldest_messages_until_the_input_fits(client, llama_server):
    """The tiny model's context is 512 tokens: 30 turns do not fit; "auto" keeps the newest that do, with room for
    max_output_tokens, and renders them as chat renders the same messages."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "the quick brown fox " * 3}
             for i in range(30)]
    with llama_server.http() as http:
        refused = http.post("/v1/responses", json={"input": turns, "max_output_tokens": 8, **GREEDY})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    response = client.responses.create(input=turns, max_output_tokens=8, truncation="auto", **GREEDY)
    assert response.truncation == "auto" and response.usage.input_tokens <= 512 - 8
    with llama_server.http() as http:
        def prompt_tokens(messages: list) -> int:
            return http.post("/tokenize", json={"messages": messages}).json()["count"]

        kept = next(k for k in range(1, 30) if prompt_tokens(turns[-k:]) == response.usage.input_tokens)
        assert prompt_tokens(turns[-kept - 1:]) > 512 - 8  # one more would not have fit
    assert 1 < kept < 30 and response.output_text == chat(client, turns[-kept:], 8).choices[0].message.content


def test_logprobs_equal_chat_completions_and_stream_with_the_text(client):
    kwargs = dict(input="hello world", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2,
                  **GREEDY)
    response = client.responses.create(**kwargs)
    expected = client.chat.completions.create(messages=[{"role": "user", "content": "hello world"}], max_tokens=6,
                                              logprobs=True, top_logprobs=2, **GREEDY)
    got = response.output[0].content[0].logprobs
    want = expected.choices[0].logprobs.content
    assert len(got) == response.usage.output_tokens == 6
    assert [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in got] == \
        [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in want]
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == [lp.token for lp in got]
    plain = client.responses.create(input="hello world", max_output_tokens=6, **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == response.output_text


@pytest.mark.parametrize("change,status,param", [
    ({"tools": [{"type": "web_search_preview"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}]}, 400, "tools"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "structured_outputs": {"json_object": True}}, 400, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, 400, "text"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"text": {"verbosity": "low"}}, 400, "text"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
    ({"n": 2}, 400, "n"),
    ({"max_tokens": 5}, 400, "max_tokens"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"background": True}, 400, "background"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"include": ["message.output_text.logprobs"], "tools": [{"type": "function", "name": "f"}]}, 400, "include"),
    ({"top_logprobs": 21}, 400, "top_logprobs"),
    ({"truncation": "middle"}, 400, "truncation"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"background_options": {"completion_window": "2h"}}, 400, "background_options"),
    ({"context_management": [{"type": "compaction"}]}, 400, "context_management"),
    ({"reasoning": {"effort": None}, "service_tier": "flex", "max_tool_calls": 3, "prompt_cache_key": "k",
      "text": {"verbosity": "medium"}, "truncation": "disabled", "include": [], "tools": [], "tool_choice": "auto"},
     200, None),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"temperature": -1}, 400, "temperature"),
])
def test_bad_requests_and_fields_that_ask_for_nothing_missing(llama_server, change, status, param):
    with llama_server.http() as http:
        response = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **change})
    assert response.status_code == status, response.text
    if status != 200:
        assert response.json()["error"]["param"] == param, response.text


def test_get_refuses_what_it_cannot_do(llama_server, client):
    stored = client.responses.create(input="hi", max_output_tokens=1, **GREEDY)
    with llama_server.http() as http:
        assert http.get(f"/v1/responses/{stored.id}", params={"stream": "true"}).status_code == 400
        assert http.get(f"/v1/responses/{stored.id}", params={"stream": "false"}).status_code == 200
    llama_server.wait_idle()


def test_store_keeps_a_bounded_number_for_a_bounded_time():
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=lambda: now[0])

    def put(response_id: str) -> None:
        store.put(ResponseObject(id=response_id, created_at=0, status="completed", model="m", output=[], store=True,
                                 temperature=1.0, top_p=1.0), [])

    put("a")
    now[0] = 5.0
    put("b")
    put("c")  # over the count: the oldest goes
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    now[0] = 10.0  # "b" (stored at 5) lives until 15
    assert store.get("b") is not None
    now[0] = 15.0
    assert store.get("b") is None and store.get("c") is None and len(store) == 0
    put("d")
    assert store.delete("d") and not store.delete("d")
